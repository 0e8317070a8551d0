"""The benchmarks' side of ``--deterministic`` (issue 54): the client pool's output digests (a
request's tokens and logprobs' bits) and their comparison, W4's fixed requests at any rate,
and the targets' table judging each figure against its same-call baseline."""

from __future__ import annotations

from bench import client_pool, det_targets, w4_bench


def test_output_digests_see_every_token_and_logprob_bit():
    base = client_pool.output_digest([5, 6, 7], [-0.5, -1.25, -2.0])
    assert base == client_pool.output_digest([5, 6, 7], [-0.5, -1.25, -2.0])
    assert base != client_pool.output_digest([5, 6, 8], [-0.5, -1.25, -2.0])
    assert base != client_pool.output_digest([5, 6, 7], [-0.5, -1.2500001, -2.0])
    assert client_pool.output_digest([5, 6, 7]) != base
    got = client_pool.compare({"a": "1", "b": "2", "c": "3"}, {"a": "1", "b": "x", "d": "4"})
    assert got == {"compared": 4, "equal": 1, "identical": False, "differ": ["b", "c", "d"]}
    assert client_pool.digests([{"ok": True, "key": 3, "digest": "d"}, {"ok": False, "key": 4}]) == {3: "d"}


def test_w4_requests_are_the_same_at_any_rate_when_their_number_is_fixed():
    slow = w4_bench.workload(60, 0, 0, 200, 180, n=50)
    fast = w4_bench.workload(180, 0, 0, 200, 180, n=50)
    assert [(p, m) for _, p, m in slow] == [(p, m) for _, p, m in fast]
    assert slow[-1][0] > fast[-1][0]   # only the arrivals differ
    assert len(w4_bench.workload(10.0, 2.0, 0, 50, 50)) == 20   # rate x duration by default


def _serving(label, **fields):
    return {"workload": label.split("-")[0], "label": label, **fields}


def test_the_targets_table_judges_each_figure_on_its_same_call_baseline(tmp_path):
    tests = tmp_path / "det-tests.txt"
    tests.write_text("40 passed in 90.1s\npytest exit 0\n")
    lines = [_serving("w1-base", output_tok_per_s=26000), _serving("w1-det", output_tok_per_s=23000),
             _serving("w2-base", itl_ms_p50=1.30, ttft_ms_p50=8.0),
             _serving("w2-det", itl_ms_p50=1.50, ttft_ms_p50=9.0),
             {"workload": "w4", "deterministic": False, "max_rate_at_slo": 225},
             {"workload": "w4", "deterministic": True, "max_rate_at_slo": 190},
             {"workload": "w4-identity", "requests": 1000, "digest": "logprobs", "deterministic": True,
              "identical_across_rates": True, "alone": {"equal": 1000, "compared": 1000, "identical": True},
              "rates": [{"rate": r, "vs_first_rate": {"equal": 1000, "compared": 1000}} for r in (60, 120)]},
             {"workload": "w5", "deterministic": True, "offloading": "off", "histories_digest": "x"},
             {"workload": "w5", "deterministic": True, "offloading": "auto", "histories_digest": "x",
              "tokens_vs_first": {"same_with_logprobs": 32, "conversations": 32}}]
    rows = {name: (got, verdict) for name, _, got, verdict in det_targets.targets(lines, str(tests))}
    assert rows["GPU tests (kernels and serving)"][1] == "met"
    assert rows["W1 tok/s, det / default"] == ("23000 / 26000 = 0.885x", "met")
    assert rows["W2 ITL p50, det / default"][1] == "NOT met"        # 1.154x > 1.10x
    assert rows["W3 tok/s, det / default"] == ("runs missing", "-")
    assert rows["W4 highest rate at the SLO, det / default"][1] == "met"   # 0.844x
    assert rows["W4 1000 requests bit-identical (logprobs) across rates and alone"][1] == "met"
    assert rows["W5 digests across host tier off/auto"][1] == "met"
