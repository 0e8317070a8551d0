"""``--deterministic`` served end to end by the Triton kernels under Triton's CPU interpreter
(``HEADRACE_KERNELS=triton``, which ``kernels`` reads at import: a process of its own): three
requests at once, chunked by a 32-token step budget, over 64-token attention splits (decode
splits dealt to programs and folded by the combine kernel, prefill tiles folding in
registers), against each alone: tokens and logprobs bit-identical."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.checkpoints import make_checkpoint

pytestmark = pytest.mark.slow   # ~10-20 s: the whole model interpreted

SCRIPT = textwrap.dedent("""
    import json, sys, warnings
    warnings.filterwarnings("ignore")
    from headrace import kernels
    from headrace.dataplane.worker import Worker, WorkerOptions
    from tests.det_harness import alone, make_request, serve

    worker = Worker(WorkerOptions(model=sys.argv[1], device="cpu", dtype="float32",
                                  num_kv_blocks=64, max_num_seqs=8, max_batched_tokens=256,
                                  deterministic=True))
    messages = [make_request(list(range(3, 150)), 3, 0.0, None),
                make_request(list(range(100, 140)), 4, 0.8, 5),
                make_request([7, 8, 9] * 10, 3, 0.9, None)]
    got = serve(worker, [messages[:2], messages[2:]], max_running=4, max_batched_tokens=32)
    print(json.dumps({"linear": kernels.linear.__module__,
                      "same": [g == alone(worker, m) for m, g in zip(messages, got)]}))
""")


def test_the_triton_kernels_serve_every_request_as_alone(tmp_path):
    model = make_checkpoint(tmp_path / "qwen3", "qwen3", heads=4, kv_heads=2, head_dim=32,
                            layers=1, vocab=512)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, HEADRACE_KERNELS="triton", TRITON_INTERPRET="1",
               HEADRACE_DET_SPLIT_TOKENS="64",
               PYTHONPATH=os.pathsep.join([root, os.path.join(root, "protos"),
                                           os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(model)], env=env, cwd=root,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["linear"] == "headrace.kernels.triton_invariant_gemm"
    assert result["same"] == [True, True, True]
