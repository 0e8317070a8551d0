"""headrace's benchmarks: scripts a user runs from the repository root as ``python -m bench.NAME``
(see bench/README.md). They sit above both planes and compose them; nothing in the product
imports them, and no test times them.

``python -m`` puts the current directory (the root) first on ``sys.path``, where its folders
named like other distributions' packages (``kernels/``: Hugging Face's ``kernels``, which
transformers imports) would stand in for them: it goes last (tests/__init__.py does the same)."""

import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _ROOT] + [_ROOT]
