"""headrace's benchmarks: scripts a user runs from the repository root as ``python -m bench.NAME``
(see bench/README.md). They sit above both planes and compose them; nothing in the product
imports them, and no test times them."""
