"""The parts of data parallelism that need no server: GPUs and memory shares per replica, the
cores' addresses and worker groups, the supervisor's children (each core with exactly a core's
secrets), a data plane's KV budget beside another process on its GPU, the cores' load messages
(merged when the stream is slow), the server's metric totals of the cores' mirrored state, and
each core's own queue bound in placement."""

from __future__ import annotations

import types

import pytest
from prometheus_client.core import GaugeMetricFamily

from headrace.cli import data_parallel as dp
from headrace.cli.main import build_parser, controlplane_parser
from headrace.cli.processes import control_plane_children
from headrace.controlplane.frontend import dp_metrics
from headrace.controlplane.kv.block_manager import BlockManager
from headrace.controlplane.core.load_publisher import LoadPublisher, merge
from headrace.core.v1 import core_pb2 as cpb


def test_replicas_take_gpus_in_turn_and_share_them_when_too_few():
    assert dp.replica_devices("cuda", 2, 2, 4) == [["cuda:0", "cuda:1"], ["cuda:2", "cuda:3"]]
    assert dp.replica_devices("cuda", 1, 2, 1) == [["cuda:0"], ["cuda:0"]]
    assert dp.replica_devices("cuda", 1, 4, 2) == [["cuda:0"], ["cuda:1"], ["cuda:0"], ["cuda:1"]]
    assert dp.replica_devices("cpu", 1, 3, None) == [["cpu"]] * 3
    assert dp.sharing(dp.replica_devices("cuda", 1, 2, 1)) == 2
    assert dp.sharing(dp.replica_devices("cuda", 2, 2, 4)) == 1
    assert dp.replica_devices("cuda", 2, 2, 2) == [["cuda:0", "cuda:1"], ["cuda:0", "cuda:1"]]
    with pytest.raises(ValueError, match="cannot share one"):
        dp.replica_devices("cuda", 2, 2, 1)


def test_device_auto_places_replicas_on_the_gpus_the_supervisor_counts():
    # serve's default device: replicas spread over (or share) the GPUs, as with --device cuda
    assert dp.resolve_auto("auto", 2) == "cuda"
    assert dp.replica_devices(dp.resolve_auto("auto", 1), 1, 2, 1) == [["cuda:0"], ["cuda:0"]]
    assert dp.replica_devices(dp.resolve_auto("auto", 2), 1, 2, 2) == [["cuda:0"], ["cuda:1"]]
    # no GPU counted: auto stays for each data plane to resolve (the CPU)
    assert dp.resolve_auto("auto", None) == dp.resolve_auto("auto", 0) == "auto"
    assert dp.replica_devices("auto", 2, 2, None) == [["auto", "auto"]] * 2
    assert dp.resolve_auto("cpu", 4) == "cpu" and dp.resolve_auto("cuda:1", None) == "cuda:1"


def test_start_up_checks_every_replicas_metrics_ports(monkeypatch):
    """Before any child starts, serve checks the control plane's /metrics (core 0 serves it; the
    other cores none) and every data plane child's: replica i's rank r on
    --dataplane-metrics-port + i x TP + r, on --metrics-host."""
    from headrace.cli import processes, serve
    from headrace.common import net

    checked = []
    monkeypatch.setattr(processes, "prepare_core_link", lambda args: None)
    monkeypatch.setattr(net, "check_port", lambda address, what="--port": checked.append((address, what)))
    args = build_parser().parse_args(["serve", "-dp", "2", "-tp", "2", "--port", "5000", "--metrics-port",
                                      "9400", "--dataplane-metrics-port", "9401", "--metrics-host", "127.0.0.2"])
    serve.check_public_ports(args)
    assert checked[1:2] == [("127.0.0.1:8000", "--http-port")]   # (the default HTTP port)
    assert checked[:1] + checked[2:] == [("127.0.0.1:5000", "--port"), ("127.0.0.2:9400", "--metrics-port")] + [
        (f"127.0.0.2:{port}", "--dataplane-metrics-port") for port in (9401, 9402, 9403, 9404)]
    argvs = [argv for i in range(2) for argv in serve.serve_children_argvs(args, ["unix:/a", "unix:/b"], None, i)]
    assert [argv[argv.index("--metrics-port") + 1] for argv in argvs] == ["9401", "9402", "9403", "9404"]
    checked.clear()
    serve.check_public_ports(build_parser().parse_args(
        ["controlplane", "-dp", "2", "--workers", "a:1,b:1", "--metrics-port", "9500"]))
    assert [what for _, what in checked] == ["--port", "--http-port", "--metrics-port"]   # no children's ports


def test_a_shared_gpu_divides_the_default_memory_and_refuses_too_much():
    assert dp.memory_utilization(0.9, 1) == 0.9
    assert dp.memory_utilization(0.9, 2) == 0.45              # the default: divided
    assert dp.memory_utilization(0.4, 2) == 0.4               # chosen, and fits
    with pytest.raises(ValueError, match="at most 0.47"):
        dp.memory_utilization(0.6, 2)


def test_visible_gpus_follow_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert dp.visible_gpus() == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert dp.visible_gpus() == 0


def test_core_addresses_and_worker_groups():
    assert dp.core_addresses(None, "/d", 1) == ["unix:/d/core.sock"]
    assert dp.core_addresses(None, "/d", 2) == ["unix:/d/core-0.sock", "unix:/d/core-1.sock"]
    assert dp.core_addresses("127.0.0.1:7000", "/d", 3) == ["127.0.0.1:7000", "127.0.0.1:7001", "127.0.0.1:7002"]
    assert dp.core_addresses("unix:/s", "/d", 2) == ["unix:/s", "unix:/s.1"]
    assert dp.core_addresses("a:1,b:2", "/d", 2) == ["a:1", "b:2"]
    with pytest.raises(ValueError, match="lists 2 addresses"):
        dp.core_addresses("a:1,b:2", "/d", 3)
    assert dp.split_workers(["a", "b", "c", "d"], 2) == [["a", "b"], ["c", "d"]]
    with pytest.raises(ValueError, match="not a multiple"):
        dp.split_workers(["a", "b", "c"], 2)


def test_serve_starts_a_core_per_replica_and_front_ends_over_all():
    args = build_parser().parse_args(["serve", "--model", "/m", "-dp", "2", "--api-server-count", "1",
                                      "--data-parallel-placement", "least-load"])
    children = control_plane_children(args, controlplane_parser(), [["unix:/w0"], ["unix:/w1"]],
                                      ["unix:/c0", "unix:/c1"])
    assert [c.role for c in children] == ["core 0", "core 1", "frontend 0"]
    core0, core1, front = (build_parser().parse_args(c.argv[4:]) for c in children)
    assert (core0.workers, core0.data_parallel_rank, core0.data_parallel_size) == ("unix:/w0", 0, 2)
    assert (core1.workers, core1.data_parallel_rank, core1.metrics_port) == ("unix:/w1", 1, 0)
    assert core0.metrics_port == 9400                     # core 0 serves the one /metrics
    assert front.core_address == "unix:/c0,unix:/c1" and front.data_parallel_placement == "least-load"


def test_a_data_plane_sharing_its_gpu_sizes_its_kv_cache_from_its_own_share(monkeypatch):
    torch = pytest.importorskip("torch")
    from headrace.dataplane import worker as worker_mod

    gib, total = 1 << 30, 100 << 30
    held = {"others": 0}   # memory another process held when this one started

    def mem_get_info(device):
        return total - held["others"] - 12 * gib, total   # this process: 10 GiB torch + 2 non-torch

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: 9 * gib)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: 10 * gib)
    w = worker_mod.Worker.__new__(worker_mod.Worker)
    w.device, w.block_bytes = torch.device("cuda", 0), gib
    w.opts = types.SimpleNamespace(gpu_memory_utilization=0.45)
    w.peak_bytes, w.graphs = 9 * gib, types.SimpleNamespace(static_bytes=lambda: 0)   # no CUDA graphs
    w.others_bytes = 0                                    # alone: 45 - 9 peak - 2 non-torch
    assert w._blocks_from_memory() == 34
    held["others"] = 50 * gib                             # another replica holds 50 GiB
    w.others_bytes = 50 * gib - worker_mod.CUDA_CONTEXT_BYTES
    assert w._blocks_from_memory() == 34 - 1               # its memory is not ours (bar the context)


def test_a_slow_streams_load_messages_merge_without_losing_a_hash():
    pending = cpb.CoreLoad(running=3, waiting=1, cached_hashes=[1, 2], evicted_hashes=[7])
    merge(pending, cpb.CoreLoad(running=0, waiting=0, cached_hashes=[3], evicted_hashes=[1]))
    assert (pending.running, pending.waiting) == (0, 0)
    assert list(pending.cached_hashes) == [1, 2, 3] and list(pending.evicted_hashes) == [7, 1]
    merge(pending, cpb.CoreLoad(running=5, cache_reset=True, cached_hashes=[9]))
    assert pending.cache_reset and list(pending.cached_hashes) == [9] and not pending.evicted_hashes


def test_the_core_sends_the_whole_cache_first_then_changes_only():
    blocks = BlockManager(8, 2)
    sched = types.SimpleNamespace(blocks=blocks, running=[], waiting=[1])
    sent = []

    class Link:
        placement, closed, push_load = True, False, staticmethod(sent.append)

    link = Link()
    service = types.SimpleNamespace(plane=types.SimpleNamespace(engine=types.SimpleNamespace(scheduler=sched)),
                                    links={link})
    publisher = LoadPublisher(service)
    publisher._fresh.add(link)
    blocks.adopt(1, [], 5)
    blocks.grow(1, 5)
    blocks.register(1, lambda: [1, 2, 3, 4, 5], 5)
    publisher.publish()
    first = sent[-1]
    assert first.cache_reset and sorted(first.cached_hashes) == sorted(blocks.cached) and first.waiting == 1
    publisher.publish()
    assert len(sent) == 1                                  # nothing changed: nothing sent
    blocks.adopt(2, [], 5)
    blocks.grow(2, 5)
    blocks.register(2, lambda: [9, 8, 7, 6, 5], 5)         # two new blocks: only they travel
    publisher.publish()
    assert not sent[-1].cache_reset and len(sent[-1].cached_hashes) == 2
    assert set(sent[-1].cached_hashes) | set(first.cached_hashes) == set(blocks.cached)
    blocks.reset_cache()
    publisher.publish()
    assert sent[-1].cache_reset and not sent[-1].cached_hashes


def test_the_servers_totals_of_the_cores_mirrored_state():
    def family(name, samples):
        f = GaugeMetricFamily("headrace:core_" + name, "doc (this core's; `core` label)", labels=["core"])
        for core, value in samples:
            f.add_metric([core], value)
        return f

    source = [family("num_requests_running", [("0", 3), ("1", 4)]),
              family("kv_cache_usage_perc", [("0", 0.5), ("1", 0.0)]),
              family("num_kv_blocks", [("0", 300), ("1", 100)]),
              family("ready", [("0", 0), ("1", 1)]),
              family("prefix_cache_hits_total", [("0", 10), ("1", 5)])]
    totals = dp_metrics.DataParallelTotals.__new__(dp_metrics.DataParallelTotals)
    totals.source = types.SimpleNamespace(collect=lambda: source)
    out = {s.name: s.value for f in totals.collect() for s in f.samples if "core" not in s.labels}
    assert out["headrace:num_requests_running"] == 7
    assert out["headrace:kv_cache_usage_perc"] == pytest.approx(0.375)   # by pool size
    assert out["headrace:ready"] == 1 and out["headrace:num_kv_blocks"] == 400
    assert out["headrace:prefix_cache_hits_total"] == 15


def test_a_resumed_requests_stop_string_finds_its_sample_by_index():
    from headrace.controlplane.core.service import CoreRequest, CoreText, EngineCoreService
    from headrace.controlplane.requests.request import Sequence
    from headrace.v1 import inference_pb2 as pb

    finished = []
    engine = types.SimpleNamespace(finish_sequence=lambda seq, reason: finished.append((seq.index, reason)),
                                   abort=lambda req: finished.append("abort"))
    service = EngineCoreService(types.SimpleNamespace(on_change=[], engine=engine))
    link = types.SimpleNamespace(requests={}, forget=lambda req: None)
    req = CoreRequest(request_id="r", n=1, link=link, handle=5)
    req.sequences = [Sequence(request=req, seq_id=1, index=2, prompt_token_ids=[1], sampling=None,
                              max_tokens=8, output=CoreText(True))]   # sample 2 of 3, alone here
    link.requests[5] = req
    service.abort(link, cpb.Abort(handle=5, reason=pb.FINISH_REASON_STOP_STRING, index=2))
    assert finished == [(2, pb.FINISH_REASON_STOP_STRING)] and req.sequences[0].final_sent


def test_every_data_parallel_core_gets_exactly_a_cores_secrets():
    from headrace.common import secret_env

    environ = {"HEADRACE_API_TOKENS": "alpha=tok-a", "HEADRACE_ADMIN_TOKEN": "adm", "PATH": "/bin",
               "HEADRACE_WORKER_SECRET": "wsec", "HEADRACE_CORE_SECRET": "csec"}
    args = build_parser().parse_args(["serve", "--model", "/m", "-dp", "2", "--api-server-count", "1"])
    secret_env.resolve(args, environ)
    children = control_plane_children(args, controlplane_parser(), [["unix:/w0"], ["unix:/w1"]],
                                      ["unix:/c0", "unix:/c1"], environ)
    secrets = lambda env: {k: v for k, v in env.items() if k in secret_env.SECRET_VARS}  # noqa: E731
    core0, core1, front = children
    assert secrets(core0.env) == secrets(core1.env) == {"HEADRACE_WORKER_SECRET": "wsec",
                                                        "HEADRACE_CORE_SECRET": "csec"}
    assert set(secrets(front.env)) == {"HEADRACE_API_TOKENS", "HEADRACE_ADMIN_TOKEN", "HEADRACE_CORE_SECRET"}
    assert all(not {"wsec", "csec", "adm"} & set(c.argv) for c in children)


def test_each_core_bounds_its_own_queue_and_placement_passes_a_full_one():
    import grpc

    from headrace.controlplane.frontend.router import CoreRouter
    from headrace.controlplane.frontend.placement import Placement
    from headrace.controlplane.requests.request import Failure
    from tests.test_scheduler import make_request

    router = CoreRouter(["unix:/c0", "unix:/c1"], 0, None, placement=Placement("round-robin"))
    for client, queued in zip(router.clients, (4, 0)):
        client.connected = True
        client._set_state(cpb.CoreState(healthy=True, loaded=True, max_queued=4))
        client._queue.num_queued = queued
    assert router.scheduler.num_queued == 0              # the early check: some core has room
    request = make_request(8, n=2)
    router.submit(request)
    assert request.request_id in router.clients[1].requests   # core 0's queue is full
    router.clients[0]._queue.num_queued = 0             # core 1 refuses it all the same (a race)
    router.clients[1].requests.pop(request.request_id)
    assert router._failed(router.clients[1], request, Failure(grpc.StatusCode.RESOURCE_EXHAUSTED, "full"))
    assert request.request_id in router.clients[0].requests
    router.clients[1]._queue.num_queued = router.clients[0]._queue.num_queued = 4   # all full:
    other = make_request(8)
    router.submit(other)                                 # a core refuses it with its own reason
    assert any(other.request_id in c.requests for c in router.clients)


def test_a_lost_cores_requests_wait_for_it_when_no_other_core_is_ready():
    import asyncio

    from headrace.controlplane.frontend.router import CoreRouter
    from headrace.controlplane.frontend.placement import Placement
    from tests.test_scheduler import make_request

    async def main():
        router = CoreRouter(["unix:/c0", "unix:/c1"], 0, None, placement=Placement("round-robin"))
        c0, c1 = router.clients
        c0.connected = True
        c0._set_state(cpb.CoreState(healthy=True, loaded=True))
        request = make_request(8, n=2)
        router.submit(request)
        assert request.request_id in c0.requests
        request.sequences[0].output_token_ids = [5, 6]   # what its samples had got
        c0._lost()                                        # core 0 gone, core 1 not ready either
        assert request.failure is None and len(c0.parked) == 1 and request.request_id in router.requests
        c0.connected = True
        c0._set_state(cpb.CoreState(healthy=True, loaded=True))   # back: resubmitted with its tokens
        assert not c0.parked and request.request_id in c0.requests
        (submit,) = c0._up.submits
        assert [list(r.output_token_ids) for r in submit.resumed] == [[5, 6], []]
    asyncio.run(main())
