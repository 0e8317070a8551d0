"""``--data-parallel-size M``: M engine cores, each with its own data plane group (its GPUs, a
share of one, or the CPU), behind the same API front ends (``headrace serve``; ``headrace
controlplane`` over running data planes). The front ends place each request on a core
(``headrace.controlplane.frontend.router``).

- GPUs (``--device cuda``, or ``auto`` when this process counts a GPU: ``resolve_auto``): rank r of replica i takes GPU i x TP + r when the machine has that
  many (``visible_gpus``: $CUDA_VISIBLE_DEVICES, else the driver's entries, else nvidia-smi);
  with fewer, the replicas' ranks take the GPUs in turn and share them (``replica_devices``).
  ``--gpu-memory-utilization`` is one process's fraction of its GPU (as vLLM's): left at its
  default it is divided among the processes sharing a GPU; set so that they would take more
  than ``MAX_SHARED`` of one GPU together, it is refused (``memory_utilization``). Replicas
  sharing a GPU load one after another: each sizes its KV cache from what it alone takes.
- Core addresses (``core_addresses``): core-i.sock in the server's private directory; a given
  ``--core-address`` is core 0's (the others take the next TCP ports, or PATH.i), or lists all.
- ``headrace controlplane --workers``: the list is cut into M groups of equal size, in order.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import time

from headrace.common import net

MAX_SHARED = 0.95          # of one GPU, for every process on it together
DEFAULT_UTILIZATION = 0.9  # WorkerOptions.gpu_memory_utilization's default


def visible_gpus() -> int | None:
    """NVIDIA GPUs this process may use (None: unknown), without importing torch:
    $CUDA_VISIBLE_DEVICES, else ``nvidia-smi -L`` (what a container was given), else the
    driver's entries."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            out = ""
        count = sum(line.startswith("GPU ") for line in out.splitlines())
        if count:
            return count
    return len(glob.glob("/proc/driver/nvidia/gpus/*")) or None


def resolve_auto(device: str, gpus: int | None) -> str:
    """``--device auto`` (the default) for data parallelism: the supervisor places the replicas
    without torch, so auto is cuda when it counts a GPU (``visible_gpus``), else it stays auto
    (each data plane then picks, as without data parallelism). Left to the data planes on a GPU
    machine, every replica would take cuda:0 with the whole default memory share."""
    if device != "auto":
        return device
    return "cuda" if gpus else "auto"


def replica_devices(device: str, tp: int, dp: int, gpus: int | None) -> list[list[str]]:
    """Each replica's devices, rank by rank."""
    if not device.startswith("cuda") or (tp == 1 and dp == 1):
        return [[device] * tp for _ in range(dp)]
    slots = tp * dp if gpus is None else max(1, gpus)
    if tp > slots:   # NCCL refuses two ranks of one group on one GPU
        raise ValueError(f"--tensor-parallel-size {tp} needs {tp} GPUs, {slots} visible: the ranks "
                         "of a tensor-parallel group cannot share one")
    return [[f"cuda:{(i * tp + r) % slots}" for r in range(tp)] for i in range(dp)]


def sharing(devices: list[list[str]]) -> int:
    """The most processes on one GPU."""
    counts: dict[str, int] = {}
    for group in devices:
        for d in group:
            if d.startswith("cuda"):
                counts[d] = counts.get(d, 0) + 1
    return max(counts.values(), default=1)


def memory_utilization(requested: float, per_gpu: int) -> float:
    """Each process's ``--gpu-memory-utilization`` when ``per_gpu`` share a GPU; ValueError when
    the requested fraction leaves them no room."""
    if per_gpu <= 1:
        return requested
    if requested == DEFAULT_UTILIZATION:
        return round(DEFAULT_UTILIZATION / per_gpu, 4)
    if requested * per_gpu > MAX_SHARED:
        raise ValueError(f"--gpu-memory-utilization {requested:g}: {per_gpu} data plane processes "
                         f"share a GPU (--data-parallel-size x --tensor-parallel-size is more than the "
                         f"GPUs), together at most {MAX_SHARED:g} of it: give each at most "
                         f"{MAX_SHARED / per_gpu:.2f}")
    return requested


def core_addresses(given: str | None, private_dir: str, dp: int) -> list[str]:
    """Where each engine core serves its front ends."""
    if not given:
        if dp == 1:
            return [f"unix:{private_dir}/core.sock"]
        return [f"unix:{private_dir}/core-{i}.sock" for i in range(dp)]
    listed = [a.strip() for a in given.split(",") if a.strip()]
    if len(listed) > 1 or dp == 1:
        if len(listed) != dp:
            raise ValueError(f"--core-address lists {len(listed)} addresses for "
                             f"--data-parallel-size {dp}: give one (core 0's) or {dp}")
        return listed
    if given.startswith("unix:"):
        return [given] + [f"{given}.{i}" for i in range(1, dp)]
    parts = net.split_address(given)
    if parts is None:
        raise ValueError(f"--core-address {given}: not unix:PATH nor HOST:PORT")
    host, port = parts
    host = f"[{host}]" if ":" in host else host
    return [f"{host}:{int(port) + i}" for i in range(dp)]


def split_workers(workers: list[str], dp: int) -> list[list[str]]:
    """``--workers`` of ``headrace controlplane`` as ``dp`` groups (each a tensor-parallel group)."""
    if dp < 1 or len(workers) % dp:
        raise ValueError(f"--workers lists {len(workers)} data planes: not a multiple of "
                         f"--data-parallel-size {dp} (each core gets an equal group, in order)")
    size = len(workers) // dp
    return [workers[i * size:(i + 1) * size] for i in range(dp)]


def wait_loaded(group, poll_s: float = 0.2) -> None:
    """Until a data plane group (``headrace.cli.supervisor.DataPlaneChildren``) has served, or
failed."""
    while not (group.served or group.fatal or group.given_up):
        time.sleep(poll_s)
