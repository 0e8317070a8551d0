"""Hot kernels of the data plane.

Each op has a plain-torch reference in ``kernels.reference``; Triton versions
(added per op) must match it. The functions exported here are what the model calls:
they pick the fastest implementation available for the tensors' device.
"""

from kernels.reference import (  # noqa: F401
    apply_rotary,
    copy_blocks,
    fused_add_rms_norm,
    paged_attention,
    rms_norm,
    silu_and_mul,
    write_kv,
)
