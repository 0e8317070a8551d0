"""A request's way in and out, shared by every public API (gRPC and HTTP): the transport-neutral
request path (readiness, limits, submit, stream), validation and wire checks, limits derived
from the model, tokenization and incremental detokenization, chat input and templates, the
model's sampling defaults, output text with stop strings, and the client-facing latencies."""
