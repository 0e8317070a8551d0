"""headrace's tests, run from the repository's root (the README's command).

The root holds folders named like other distributions' packages (``kernels/``: Hugging Face's
``kernels``, which transformers imports), and pytest puts it first on ``sys.path``, where its
folders would stand in for those packages. It goes last instead: the project itself is imported
as ``headrace`` (the installed package), and ``tests`` and ``bench`` are still found there."""

import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _ROOT] + [_ROOT]
