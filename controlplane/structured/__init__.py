"""Structured outputs in the control plane: a request's constraint (``spec``), the grammar
engines (``backends``: llguidance by default, ``guidance``; ``xgrammar`` selectable), compiling
off the event loop with a cache (``compiler``), and the engine's per-sequence matchers and
per-step token bitmasks (``outputs``). The data plane only applies the bitmasks
(``headrace.dataplane.bitmasks``, ``kernels.apply_token_bitmask``). docs/structured_outputs.md."""
