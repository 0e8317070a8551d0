"""What a W5 run's rows say (``bench.w5_bench``): the control plane's tier counters read from its
/metrics, how one mode's generated tokens compare with another's conversation by conversation
(where they first differ: docs/kv_offloading.md, *Exactness*), and the closing table."""

from __future__ import annotations

import re
import statistics
import urllib.request


def first_divergence(a: list[list[int]], b: list[list[int]]) -> tuple[int, int] | None:
    """(turn, token) where one conversation's outputs first differ in two runs; None: same."""
    for t, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return t, next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
    return None


def compare(row: dict, base: dict) -> dict:
    """How ``row``'s generated tokens compare with ``base``'s, conversation by conversation."""
    diffs = [d for d in map(first_divergence, row["_outputs"], base["_outputs"]) if d is not None]
    out = {"vs": base["offloading"], "same_conversations": len(row["_outputs"]) - len(diffs),
           "conversations": len(row["_outputs"])}
    if any(t for conv in row.get("_logprobs", []) for t in conv):   # asked for (--deterministic)
        out["same_with_logprobs"] = sum(a == b and x == y for a, b, x, y in zip(
            row["_outputs"], base["_outputs"], row["_logprobs"], base["_logprobs"]))
    if diffs:
        out["first_divergence_turn_min"] = min(t for t, _ in diffs)
        out["first_divergence_turn_median"] = statistics.median(t for t, _ in diffs)
        out["first_divergence_token_median"] = statistics.median(i for _, i in diffs)
    return out


_METRIC = re.compile(r'headrace:(prefix_cache_queries_total|kv_tier_prefix_hits_total\{tier="(\w+)"\}|'
                     r'kv_offload_blocks_total\{direction="(\w+)"\}|kv_offload_copy_seconds_total|'
                     r'kv_tier_host_hits_recomputed_total|kv_tier_seconds_per_token\{action="(\w+)"\}) (\S+)')


def tier_hits(metrics_port: int) -> dict:
    """Prefix-cache tokens looked up, and found per tier; blocks copied each way; host hits
    recomputed; the cost rule's estimates (``s_per_token_load`` / ``_recompute``), from the
    control plane's /metrics."""
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        m = _METRIC.match(line)
        if m:
            key = (m.group(2) or (m.group(3) and "blocks_" + m.group(3))
                   or (m.group(4) and "s_per_token_" + m.group(4)) or m.group(1).replace("_total", ""))
            out[key] = float(m.group(5))
    return out


def table(rows: list[dict]) -> None:
    off = next((r for r in rows if r["offloading"] == "off"), None)
    print(f"{'offload':>13} {'TTFT p50':>9} {'vs off':>7} {'p99':>9} {'later p50':>9} {'tok/s':>8} {'vs off':>7} "
          f"{'dev hit':>8} {'host hit':>8} {'recomp.':>8} {'load us':>8} {'recomp us':>9} {'same as first':>13}")
    for r in rows:
        ttft = f"{off['ttft_ms_p50'] / r['ttft_ms_p50']:.2f}x" if off and r["ttft_ms_p50"] else "-"
        tput = f"{r['output_tok_per_s'] / off['output_tok_per_s']:.2f}x" if off and off["output_tok_per_s"] else "-"
        vs = r.get("tokens_vs_first")
        same = f"{vs['same_conversations']}/{vs['conversations']}" if vs else "-"
        print(f"{r['offloading']:>13} {r['ttft_ms_p50']:>9} {ttft:>7} {r['ttft_ms_p99']:>9} "
              f"{r['later_turns_ttft_ms_p50']:>9} {r['output_tok_per_s']:>8} {tput:>7} {r['hit_rate_device']!s:>8} "
              f"{r['hit_rate_host']!s:>8} {r['host_hits_recomputed']:>8} {r['load_us_per_token']:>8} "
              f"{r['recompute_us_per_token']:>9} {same:>13}")
    for alone in (False, True):
        digests = {r["histories_digest"] for r in rows if r["offloading"].endswith("/alone") == alone}
        if digests:
            print(f"same tokens in every {'alone ' if alone else ''}mode: {'yes' if len(digests) == 1 else 'NO'}")
    print("vs off: off's TTFT p50 over the mode's, the mode's throughput over off's; same as first: "
          "conversations whose tokens equal the first mode's of its kind (docs/kv_offloading.md, Exactness)")
