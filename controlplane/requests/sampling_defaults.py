"""The model's sampling defaults from its generation_config.json (temperature, top_p, top_k, min_p,
repetition_penalty, max_new_tokens), applied to requests that leave those fields unset, as vLLM
does with ``--generation-config auto``. ``--generation-config vllm`` ignores them.

In ``SamplingParams`` ``top_k`` and ``min_p`` are plain fields: 0 counts as unset there.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import pathlib

from headrace.v1 import inference_pb2 as pb

log = logging.getLogger("headrace.controlplane")
_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclasses.dataclass(frozen=True)
class SamplingDefaults:
    values: dict = dataclasses.field(default_factory=dict)   # SamplingParams field -> value
    max_tokens: int | None = None   # max_new_tokens: the default max_tokens (capped by the room left)

    @classmethod
    def load(cls, model_dir: str | pathlib.Path, mode: str = "auto") -> "SamplingDefaults":
        if mode == "vllm":
            return cls()
        if mode != "auto":
            raise ValueError(f"--generation-config must be 'auto' or 'vllm', got {mode!r}")
        file = pathlib.Path(model_dir) / "generation_config.json"
        if not file.exists():
            return cls()
        try:
            raw = json.loads(file.read_text())
        except (OSError, ValueError) as exc:
            log.warning("ignoring unreadable %s: %s", file, exc)
            return cls()
        values = {}
        for key in _KEYS:
            value = raw.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                values[key] = int(value) if key == "top_k" else float(value)
        max_new = raw.get("max_new_tokens")
        defaults = cls(values, max_new if isinstance(max_new, int) and max_new > 0 else None)
        if defaults.values or defaults.max_tokens:
            log.info("sampling defaults from %s: %s%s", file, values,
                     f", max_tokens {defaults.max_tokens}" if defaults.max_tokens else "")
        return defaults

    def apply(self, request: pb.GenerateRequest) -> pb.GenerateRequest:
        """``request`` itself when nothing applies, else a copy with the sampling defaults filled
        in (``max_tokens`` goes to ``build_request``, which caps it by the prompt's room)."""
        s = request.sampling
        missing = {k: v for k, v in self.values.items()
                   if not (s.HasField(k) if k in ("temperature", "top_p", "repetition_penalty")
                           else getattr(s, k))}
        if not missing:
            return request
        out = pb.GenerateRequest()
        out.CopyFrom(request)
        for key, value in missing.items():
            setattr(out.sampling, key, value)
        return out
