"""The layer both planes share: tracing, structured logs, transport security, the Prometheus
exporter base, the gRPC server/channel settings, listening addresses, where a model comes
from (a directory or a Hub id), and the data plane worker's options (which the command line
serialises to a child's argv). Nothing here imports either plane or torch."""
