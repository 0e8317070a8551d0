"""bench/quant_kernels.py's parts that run without a GPU: which kernels it measures, the tiles
its sweep times per row bucket (the fixed tile first), and the table it writes, read back by
``headrace.kernels.quant_dispatch`` (rankings and pinned tiles)."""

from __future__ import annotations

import dataclasses
import json

from tests.triton_device import triton_device

DEVICE = triton_device()
from bench import quant_kernels as qk  # noqa: E402
from headrace.kernels import quant_dispatch, skinny_gemm  # noqa: E402
from headrace.kernels.skinny_gemm import Tile  # noqa: E402


def test_candidates_are_ours_and_the_libraries_asked_for():
    assert qk.candidates("w4a16", 4096, 4096, libs=set()) == ["triton_skinny", "triton_tiled",
                                                              "triton"]
    assert "triton_tiled" not in qk.candidates("w4a16", 4104, 4096, libs=set())   # N % 16
    assert qk.candidates("fp8", 4096, 4096, libs=set()) == ["fp8_skinny", "fp8_w8a8",
                                                            "fp8_w8a8_inline", "scaled_mm"]


def test_the_sweep_times_the_fixed_tile_first():
    sweep = qk.sweep_tiles("fp8", "fp8_skinny", 6144, 4096, 1, 4)
    first = qk.triton_fp8_linear.TILES[1][0]
    assert sweep[0] == qk.triton_fp8_linear.TUNER.split(first, 1, 6144, 4096, 132)
    w8a8 = [qk.sweep_tiles("fp8", "fp8_w8a8", n, 4096, 16, 2)[0] for n in (4096, 28672)]
    assert [t.split for t in w8a8] == [4, 1]   # 64 programs split, 448 (over 2 an SM) not
    assert len(sweep) == len(set(sweep)) <= 4
    w4 = qk.sweep_tiles("w4a16", "triton_skinny", 28672, 4096, 16, 3)
    assert all(t.block_k == qk.triton_w4a16.BLOCK_K for t in w4) and len(w4) <= 3
    assert qk.sweep_tiles("fp8", "fp8_skinny", 4096, 4096, 64, 0)[:1] == \
        qk.sweep_tiles("fp8", "fp8_skinny", 4096, 4096, 64, 1)


def test_the_table_it_writes_pins_tiles_for_the_dispatch(tmp_path):
    rankings = {"fp8": {"6144x4096": {"1": ["fp8_skinny", "scaled_mm"]}}}
    tiles = {"fp8": {"6144x4096": {str(skinny_gemm.m_bucket(1)): Tile(1, 32, 256, split=4,
                                                                      dot=False).as_list()}},
             "w4a16": {}}
    path = tmp_path / "quant_dispatch.json"
    path.write_text(json.dumps(qk.table(rankings, tiles, [1], "abc")))
    assert quant_dispatch.load_table(path) == rankings
    pinned = quant_dispatch.load_tiles(path)
    assert pinned == {"fp8": tiles["fp8"]}
    assert Tile.from_list(pinned["fp8"]["6144x4096"]["1"]) == Tile(1, 32, 256, split=4, dot=False)


def test_the_bench_runs_end_to_end_on_a_tiny_shape(tmp_path, monkeypatch, capsys):
    """main() on one small shape under the interpreter (timing stubbed): every scheme's table,
    the targets, the sweep's lines, and a table file the dispatch reads."""
    monkeypatch.setattr(qk, "DEVICE", "cpu")
    monkeypatch.setattr(qk, "SHAPES", {"tiny": (128, 256)})
    monkeypatch.setattr(qk, "ROTATE_BYTES", 1)
    monkeypatch.setattr(qk, "graph_ms", lambda calls, replays=10: [c() for c in calls] and 1e-3)
    out = tmp_path / "t.json"
    monkeypatch.setattr("sys.argv", ["quant_kernels", "--m", "1,16", "--shapes", "tiny",
                                     "--table", str(out), "--rows"])
    monkeypatch.setenv("HEADRACE_COMMIT", "abc1234")     # a tree whose git metadata is stale
    qk.main()
    assert json.loads(out.read_text())["commit"] == "abc1234"
    printed = capsys.readouterr().out
    assert "target fp8 M=1" in printed and "target w4a16 M=16" in printed
    # the W8A8 kernels also timed on quantised rows (scaled_mm and ours: no library here)
    assert "fp8_w8a8 M=1 1.0" in printed.split("on quantised rows")[1]
    assert set(quant_dispatch.load_tiles(out)["fp8_w8a8"]["128x256"]) == {"1", "16"}
    assert set(quant_dispatch.load_tiles(out)["fp8_w8a8_inline"]["128x256"]) == {"1", "16"}
    assert "  fp8_skinny 128x256 M=1:" in printed and "  triton_skinny 128x256 M=16:" in printed
    assert set(quant_dispatch.load_table(out)) == {"fp8", "w4a16"}
    assert set(quant_dispatch.load_tiles(out)["w4a16"]["128x256"]) == {"1", "16"}


def test_ranking_on_quantised_rows_takes_the_rows_times_for_those_layers(tmp_path, monkeypatch,
                                                                         capsys):
    """--rank-on-rows: a layer the norm / SiLU kernels feed (qkv here) ranks its W8A8 kernels
    by their time on quantised rows; o keeps the times with the quantiser."""
    monkeypatch.setattr(qk, "DEVICE", "cpu")
    monkeypatch.setattr(qk, "SHAPES", {"qkv": (128, 256), "o": (64, 128)})
    monkeypatch.setattr(qk, "ROTATE_BYTES", 1)
    monkeypatch.setattr(qk, "graph_ms", lambda calls, replays=10: [c() for c in calls] and 1e-3)
    monkeypatch.setattr(qk, "on_rows", lambda kernel, w, ms, tiles: {m: 0.5 for m in ms})
    out = tmp_path / "t.json"
    monkeypatch.setattr("sys.argv", ["quant_kernels", "--m", "1", "--schemes", "fp8",
                                     "--table", str(out), "--rows", "--rank-on-rows"])
    qk.main()
    ranked = quant_dispatch.load_table(out)["fp8"]
    assert set(ranked["128x256"]["1"][:2]) == {"fp8_w8a8", "scaled_mm"}   # at 0.5 µs: first
    assert ranked["64x128"]["1"][0] == "fp8_skinny"        # o: every kernel timed alike
    assert "timed on quantised rows" in capsys.readouterr().out


def test_a_wrong_swept_tile_is_reported_and_never_pinned(monkeypatch, capsys):
    """measure() checks each tile of the sweep against the reference before timing it: a tile
    whose output is off is printed as WRONG and cannot win its bucket, though timed fastest."""
    monkeypatch.setattr(qk, "DEVICE", "cpu")
    fixed = qk.sweep_tiles("w4a16", "triton_skinny", 128, 256, 16, 1)[0]
    bad = dataclasses.replace(fixed, split=2)     # (the interpreter's lists hold one tile)
    monkeypatch.setattr(qk, "sweep_tiles", lambda *args: [fixed, bad])
    real = qk._caller

    def caller(scheme, kernel, w, tile=None):
        call = real(scheme, kernel, w, tile)
        return (lambda x: call(x) + 1.0) if tile == bad else call

    times = iter([1e-3, 1e-4])            # the sweep's order: the fixed tile, then the bad one
    monkeypatch.setattr(qk, "_caller", caller)
    monkeypatch.setattr(qk, "graph_ms", lambda calls, replays=10: next(times))
    by_m = {}
    out = qk.measure("w4a16", "triton_skinny", [qk._weights("w4a16", 128, 256, 0)], 128, 256,
                     [16], 2, by_m)
    assert by_m[16] == fixed and out[16] == 1.0
    assert f"tile {bad.as_list()} WRONG" in capsys.readouterr().out
