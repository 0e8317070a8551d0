"""The LoRA adapters an engine serves (multi-LoRA serving, docs/lora.md), the control plane's
side: the registry of adapter names and paths and the rule the scheduler admits by
(``registry``), which data-plane device slots and host caches hold which adapter, least
recently used first (``slots``), what the public APIs say of them and their runtime load and
unload (``api``), and their Prometheus metrics (``metrics``)."""
