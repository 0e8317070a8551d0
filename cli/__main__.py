"""``python -m headrace.cli ...``: the ``headrace`` command (how ``serve`` starts its data planes).

A process that imported torch (a data plane) ends without the interpreter's teardown once its
command returned (server stopped, metrics and traces flushed, logs flushed here): torch's
module teardown holds nothing of ours and takes ~0.7 s on a CPU, which every shutdown,
restart and rolling update of ``headrace serve`` would wait for."""

import logging
import os
import sys

from headrace.cli.main import main

code = main()
if "torch" in sys.modules:
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code if isinstance(code, int) else 1 if code else 0)
sys.exit(code)
