"""The ``headrace`` command line, above both planes: it starts the control plane, a data plane,
or both (``serve``: the control plane here, data planes as ``python -m headrace.cli dataplane``
children), and holds the small clients (``generate``, ``admin``, ``health``). Only the
``dataplane`` command imports the data plane (and so torch)."""

import os

# gRPC's C core logs at INFO (e.g. a GOAWAY from a data plane that stops) unless told otherwise:
# a command line shows errors only, unless GRPC_VERBOSITY says more. Set before grpc loads.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
