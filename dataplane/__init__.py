"""The data plane: one process per GPU (or the CPU) that holds model weights and the paged
KV cache and executes the steps the control plane sends it."""
