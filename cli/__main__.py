"""``python -m cli ...``: the ``headrace`` command (how ``serve`` starts its data planes)."""

import sys

from cli.main import main

sys.exit(main())
