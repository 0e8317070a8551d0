"""Quantized weights and their loading: scheme detection (``config``), per-format readers
(``formats``), the quantized linear layers (``layers``) and the loader seam (``loading``).
See docs/quantization.md."""

from dataplane.quantization.config import (KV_CACHE_DTYPES, METHODS, QuantConfig,
                                           QuantizationError, resolve)

__all__ = ["KV_CACHE_DTYPES", "METHODS", "QuantConfig", "QuantizationError", "resolve"]
