"""The table of `bash benchmarks/h200_bench.sh vllm`: tokens/s (median of the rounds, with their range), TTFT and TPOT
(medians of the rounds' percentiles) by server and concurrency, and vLLM's acceptance on each bundle's held-out
prompts against eval.json.

    python3 benchmarks/serving_table.py OUT_DIR      (OUT_DIR holds bench_<server>.json and vllm_check_<kind>.json)
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

SERVERS = {
    "vllm_plain": "vLLM, no speculation",
    "vllm_eagle3": "vLLM + EAGLE-3 bundle",
    "draftsmith_eagle3": "draftsmith serve + EAGLE-3 bundle",
    "vllm_draft_model": "vLLM + W4A16 draft bundle",
    "draftsmith_draft_model": "draftsmith serve + W4A16 draft bundle",
}


def rounds_of(out: Path, name: str) -> dict[int, list[dict]]:
    """Concurrency -> the rows of every round of one server (bench_<name>.json or bench_<name>_round<i>.json)."""
    levels: dict[int, list[dict]] = {}
    for path in sorted([*out.glob(f"bench_{name}.json"), *out.glob(f"bench_{name}_round*.json")]):
        for row in json.loads(path.read_text())["rows"]:
            levels.setdefault(row["concurrency"], []).append(row)
    return levels


def median_of(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if r[key] is not None]
    return round(statistics.median(values), 2) if values else None


def main(out: Path) -> None:
    print("| server | concurrency | tokens/s, median (range, rounds) | TTFT p50 / p99 ms | TPOT p50 / p99 ms | errors |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, title in SERVERS.items():
        levels = rounds_of(out, name)
        if not levels:
            print(f"| {title} | | did not run (see serve_{name}.log) | | | |")
            continue
        for concurrency, rows in levels.items():
            mid = lambda key: median_of(rows, key)
            speeds = [r["tokens_per_s"] for r in rows]
            print(
                f"| {title} | {concurrency} | {mid('tokens_per_s')} ({min(speeds)}-{max(speeds)}, {len(rows)}) | "
                f"{mid('ttft_p50_ms')} / {mid('ttft_p99_ms')} | {mid('tpot_p50_ms')} / {mid('tpot_p99_ms')} | "
                f"{sum(r['errors'] for r in rows)} |"
            )
    print()
    for path in sorted(out.glob("vllm_check_*.json")):
        r = json.loads(path.read_text())
        pos = lambda xs: ", ".join(f"{x:.4f}" for x in xs)
        print(
            f"{path.stem[len('vllm_check_') :]}: K={r['k']} ({r['schedule']}), {r['num_prompts']} prompts: vLLM [{pos(r['vllm']['acceptance_by_position'])}] "
            f"vs eval.json [{pos(r['eval_json']['acceptance_by_position'])}]; accepted/drafted {r['vllm']['acceptance_rate']:.4f} vs "
            f"{r['eval_json']['acceptance_rate']:.4f}; {'DISAGREES: ' + '; '.join(r['disagreements']) if r['disagreements'] else 'agrees'}"
        )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
