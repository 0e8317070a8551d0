"""headrace: the one package the project installs.

Its subpackages come from the repository's top-level folders (pyproject's package-dir):
``headrace.controlplane`` (controlplane/), ``headrace.dataplane`` (dataplane/),
``headrace.kernels`` (kernels/), ``headrace.common`` (common/), ``headrace.cli`` (cli/),
``headrace.client`` (client/); this folder holds the namespace's root and the gRPC code
generated from its .proto files (``python protos/codegen.py``): ``headrace.v1`` (the public
API), ``headrace.core.v1`` (engine core <-> API front ends), ``headrace.worker.v1`` (the step
protocol between the planes)."""
