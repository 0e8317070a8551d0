"""Quantized weights and their loading: scheme detection (``config``), per-format readers
(``formats``), the quantized linear layers (``layers``) and the loader seam (``loading``).
See docs/quantization.md."""

from headrace.dataplane.quantization.config import (FP8_KV_CACHE_DTYPES, KV_CACHE_DTYPES, METHODS,
                                                    QuantConfig, QuantizationError, resolve)

__all__ = ["FP8_KV_CACHE_DTYPES", "KV_CACHE_DTYPES", "METHODS", "QuantConfig", "QuantizationError", "resolve"]
