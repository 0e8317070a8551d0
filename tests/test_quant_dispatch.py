"""Which kernel a quantized layer runs (``headrace.kernels.quant_dispatch``): the Triton defaults,
the measured table's rankings under ``--quant-backend auto``, the library families, and the start-up
check of the flag."""

from __future__ import annotations

import json

import pytest

from headrace.kernels import quant_dispatch as qd

LLAMA_QKV = (6144, 4096)
RANKINGS = {"w4a16": {"6144x4096": {"1": ["tinygemm", "triton_skinny", "gemlite"],
                                    "16": ["gemlite", "triton_skinny"],
                                    "256": ["triton", "tinygemm"]}},
            "fp8": {"6144x4096": {"1": ["fbgemm_rowwise", "fp8_skinny"],
                                  "64": ["scaled_mm", "fp8_skinny"]}}}


def _by_bucket(plan):
    return dict(plan.by_bucket)


def test_buckets():
    assert [qd.bucket_of(m) for m in (1, 3, 8, 9, 100, 128, 129, 256, 257, 10_000)] == \
        [1, 4, 8, 16, 128, 128, 256, 256, 8192, 8192]


def test_the_triton_backend_is_every_default():
    fp8 = _by_bucket(qd.plan("fp8", *LLAMA_QKV, "triton", lambda name: True, RANKINGS))
    assert set(fp8[b] for b in qd.BUCKETS if b <= qd.MAX_ROWS) == {"fp8_skinny"}
    assert fp8[256] == fp8[8192] == "scaled_mm"
    w4 = qd.plan("w4a16", *LLAMA_QKV, "triton", lambda name: True, RANKINGS)
    assert w4.kernel(1) == w4.kernel(128) == "triton_skinny" and w4.kernel(129) == "triton"
    # a layer the skinny kernel does not take (groups of 64, a g_idx): the general kernel
    general = qd.plan("w4a16", *LLAMA_QKV, "triton", lambda name: False, RANKINGS)
    assert general.kernels == {"triton"}


def test_auto_takes_the_fastest_measured_kernel_that_can_run():
    everything = qd.plan("w4a16", *LLAMA_QKV, "auto", lambda name: True, RANKINGS)
    # M=1 ranking for bucket 1; bucket 2..16 read M=16's; 32..256 read M=256's
    assert everything.kernel(1) == "tinygemm"
    assert everything.kernel(2) == everything.kernel(16) == "gemlite"
    assert everything.kernel(17) == everything.kernel(500) == "triton"
    no_libraries = qd.plan("w4a16", *LLAMA_QKV, "auto",
                           lambda name: name == "triton_skinny", RANKINGS)
    assert no_libraries.kernel(1) == no_libraries.kernel(16) == "triton_skinny"
    assert no_libraries.kernel(200) == "triton"
    fp8 = qd.plan("fp8", *LLAMA_QKV, "auto", lambda name: False, RANKINGS)
    assert fp8.kernel(1) == "fp8_skinny"       # fbgemm not installed: the next one
    assert fp8.kernel(64) == fp8.kernel(300) == "scaled_mm"   # beyond 64 rows: M=64's ranking
    # 8-bit layers read their own rankings (none here), not the 4-bit ones
    assert qd.plan("w8a16", *LLAMA_QKV, "auto", lambda name: True, RANKINGS).kernel(1) == \
        "triton_skinny"
    # a shape the table does not hold: the defaults
    other = qd.plan("fp8", 1024, 1024, "auto", lambda name: True, RANKINGS)
    assert other.kernel(1) == "fp8_skinny" and other.kernel(129) == "scaled_mm"


def test_library_backends_run_their_family_where_it_takes_the_layer():
    torch_b = qd.plan("w4a16", *LLAMA_QKV, "torch", lambda name: name == "tinygemm", RANKINGS)
    assert torch_b.kernels == {"tinygemm"}
    assert qd.plan("fp8", *LLAMA_QKV, "torch", lambda name: True, RANKINGS).kernels == {"scaled_mm"}
    gem = qd.plan("w4a16", *LLAMA_QKV, "gemlite", lambda name: name == "triton_skinny", RANKINGS)
    assert gem.kernel(1) == "triton_skinny" and gem.kernel(300) == "triton"   # gemlite can't
    fb = qd.plan("fp8", *LLAMA_QKV, "fbgemm", lambda name: True, RANKINGS)
    assert fb.kernels == {"fbgemm_rowwise"}
    assert "1: fbgemm_rowwise" in fb.describe() and "129-256: fbgemm_rowwise" in fb.describe()
    assert ">256: fbgemm_rowwise" in fb.describe()


def test_the_backend_flag_is_checked_at_start_up():
    def missing(library):
        return f"the {library} package is not installed (pip install 'headrace[{library}]')"

    assert qd.resolve_backend("auto", "cpu", missing) == "auto"
    assert qd.resolve_backend("triton", "cuda", missing) == "triton"
    with pytest.raises(ValueError, match=r"headrace\[gemlite\]"):
        qd.resolve_backend("gemlite", "cuda", missing)
    with pytest.raises(ValueError, match="need a CUDA device"):
        qd.resolve_backend("fbgemm", "cpu", lambda library: None)
    with pytest.raises(ValueError, match="choose from"):
        qd.resolve_backend("marlin", "cuda", missing)
    assert qd.resolve_backend("torch", "cuda", lambda library: None) == "torch"
    with pytest.raises(ValueError, match="choose from"):
        qd.plan("fp8", 8, 8, "cutlass", lambda name: True, {})


def test_the_table_file(tmp_path):
    assert qd.load_table(tmp_path / "absent.json") == {}
    good = tmp_path / "t.json"
    good.write_text(json.dumps({"device": "NVIDIA H200", "rankings": RANKINGS}))
    assert qd.load_table(good) == RANKINGS
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"rankings": {"fp8": {"8x8": {"1": ["marlin"]}}}}))
    with pytest.raises(ValueError, match="unknown kernels"):
        qd.load_table(bad)
    qd.load_table()     # the committed table (if any) is well formed


def test_the_table_pins_skinny_tiles(tmp_path, monkeypatch):
    """"tiles" (the bench's sweep winners) pin a launch per scheme, shape and row bucket;
    malformed entries are refused; absent ones (or no file) pin nothing."""
    tiles = {"fp8": {"6144x4096": {"1": [1, 32, 256, 4, 3, 4, 0], "64": [64, 64, 128, 4, 3, 2, 1]}}}
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"rankings": RANKINGS, "tiles": tiles}))
    assert qd.load_tiles(path) == tiles and qd.load_tiles(tmp_path / "absent.json") == {}
    monkeypatch.setattr(qd, "_TILES", qd.load_tiles(path))
    assert qd.pinned_tile("fp8", *LLAMA_QKV, 64) == [64, 64, 128, 4, 3, 2, 1]
    assert qd.pinned_tile("fp8", *LLAMA_QKV, 16) is None
    assert qd.pinned_tile("w4a16", *LLAMA_QKV, 1) is None
    path.write_text(json.dumps({"tiles": {"fp8": {"6144x4096": {"1": [1, 32, 256]}}}}))
    with pytest.raises(ValueError, match="is not"):
        qd.load_tiles(path)
    qd.load_tiles()     # the committed table's tiles (if any) are well formed


def test_a_layer_holds_at_most_its_layout_budget_of_weight_copies(monkeypatch):
    """tinygemm (M = 1), the tiled INT4 kernel (2-16) and FBGEMM (32 up) each hold the weight
    once more: under a budget of one extra layout the plan keeps the one that runs the most
    row buckets (FBGEMM's five) and gives the others' buckets to the next ranked kernel;
    HEADRACE_QUANT_LAYOUTS sets the layers' budget (default 1, 'all': none)."""
    ranked = {"w4a16": {"6144x4096": {"1": ["tinygemm", "triton_skinny"],
                                      "16": ["triton_tiled", "triton_skinny"],
                                      "64": ["fbgemm_i4", "triton_tiled"],
                                      "256": ["fbgemm_i4", "triton"]}}}
    every = qd.plan("w4a16", *LLAMA_QKV, "auto", lambda name: True, ranked)
    assert every.kernels == {"tinygemm", "triton_tiled", "fbgemm_i4"}
    one = qd.plan("w4a16", *LLAMA_QKV, "auto", lambda name: True, ranked, max_layouts=1)
    assert one.kernel(1) == one.kernel(16) == "triton_skinny"
    assert one.kernel(32) == one.kernel(4096) == "fbgemm_i4"
    two = qd.plan("w4a16", *LLAMA_QKV, "auto", lambda name: True, ranked, max_layouts=2)
    assert two.kernel(1) == "triton_skinny" and two.kernel(8) == "triton_tiled"
    none = qd.plan("w4a16", *LLAMA_QKV, "auto", lambda name: True, ranked, max_layouts=0)
    assert none.kernels == {"triton_skinny", "triton"}
    # FBGEMM's row-wise FP8 GEMM reads the weight as it is: no copy, no budget
    assert "fbgemm_rowwise" not in qd.OWN_LAYOUT
    monkeypatch.delenv("HEADRACE_QUANT_LAYOUTS", raising=False)
    assert qd.layout_budget() == 1
    monkeypatch.setenv("HEADRACE_QUANT_LAYOUTS", "all")
    assert qd.layout_budget() is None
    monkeypatch.setenv("HEADRACE_QUANT_LAYOUTS", "3")
    assert qd.layout_budget() == 3
    monkeypatch.setenv("HEADRACE_QUANT_LAYOUTS", "many")
    with pytest.raises(ValueError, match="HEADRACE_QUANT_LAYOUTS"):
        qd.layout_budget()
