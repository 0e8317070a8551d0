"""The control plane: public gRPC API, validation, tokenization, scheduling, paged-KV block
tables, and streaming to clients. It drives data plane workers over gRPC step streams."""
