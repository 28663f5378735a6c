"""The table of `bash benchmarks/h200_bench.sh vllm`: tokens/s, TTFT and TPOT by server and concurrency, and vLLM's
acceptance on each bundle's held-out prompts against eval.json.

    python3 benchmarks/serving_table.py OUT_DIR      (OUT_DIR holds bench_<server>.json and vllm_check_<kind>.json)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SERVERS = {
    "vllm_plain": "vLLM, no speculation",
    "vllm_eagle3": "vLLM + EAGLE-3 bundle",
    "draftsmith_eagle3": "draftsmith serve + EAGLE-3 bundle",
    "vllm_draft_model": "vLLM + W4A16 draft bundle",
    "draftsmith_draft_model": "draftsmith serve + W4A16 draft bundle",
}


def main(out: Path) -> None:
    print("| server | concurrency | tokens/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | requests (errors) |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, title in SERVERS.items():
        path = out / f"bench_{name}.json"
        if not path.is_file():
            print(f"| {title} | | did not run (see serve_{name}.log) | | | |")
            continue
        for row in json.loads(path.read_text())["rows"]:
            print(
                f"| {title} | {row['concurrency']} | {row['tokens_per_s']} | {row['ttft_p50_ms']} / {row['ttft_p99_ms']} | "
                f"{row['tpot_p50_ms']} / {row['tpot_p99_ms']} | {row['requests']} ({row['errors']}) |"
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
