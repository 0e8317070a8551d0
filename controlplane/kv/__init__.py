"""The KV cache as the control plane decides it: the paged block manager with its prefix
cache, the host-memory tier (its pool, index and copies), the cost rule that loads or
recomputes a host hit, prefetch of host blocks ahead of compute, and the summary of the
prefix cache that data-parallel front ends place requests by."""
