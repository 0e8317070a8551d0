"""The ``headrace`` command line, above both planes: it starts the control plane, a data plane,
or both (``serve``: the control plane here, data planes as ``python -m cli dataplane``
children), and holds the small clients (``generate``, ``admin``, ``health``). Only the
``dataplane`` command imports the data plane (and so torch)."""
