"""vLLM itself judges a bundle: it loads the target with the bundle's draft and speculative config, decodes
the bundle's held-out prompts greedily, and its own acceptance counters are compared with eval.json.

    VLLM_TARGET_DEVICE=cpu .venv-vllm/bin/python pipeline/vllm_check.py BUNDLE TARGET [--tolerance 0.03] [--out FILE]
    python3 pipeline/vllm_check.py BUNDLE --url http://HOST:PORT      (a running `vllm serve` of the bundle)

`make vllm-check BUNDLE=...` runs it in a venv of its own (vLLM pins its own torch), after resolving the
target the bundle names. It imports vLLM only, not draftsmith. vLLM runs as a user would run it:
`LLM(model=TARGET, speculative_config=<speculative_config.json, model = the bundle's draft/>)`, greedy, on the
token ids of eval_prompts.json with eval.json's max_new_tokens. Its counters (vllm:spec_decode_num_drafts,
..._num_accepted_tokens_per_pos) give acceptance by position, accepted / drafted and the mean acceptance
length, which must agree with eval.json's row of the shipped draft at the bundle's K and T = 0 within
the tolerance, position by position. With --url, the same prompts go to a running `vllm serve` of the bundle
(the bundle's serve.sh) as /v1/completions requests, at most as many at once as the K checked allows, and the
counters are the difference of its /metrics before and after.

Exit 0: vLLM loaded and decoded the bundle and agrees; 1: vLLM refused the bundle (its own message follows)
or its acceptance disagrees (both numbers follow); 2: the bundle lacks what the check needs, or usage.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

TOLERANCE = 0.03  # per position: eval.json computes acceptance exactly from one teacher-forced pass; vLLM's
# run differs only where float rounding flips a near-tie (bf16 on a CPU for a W4A16 draft) and at sequence ends
PROMPTS = "eval_prompts.json"


class Unusable(Exception):
    """The bundle lacks what the check needs (exit 2)."""


def max_model_len(bundle: Path) -> int | None:
    """The --max-model-len that the bundle's serve.sh passes to vllm serve."""
    found = re.search(r"--max-model-len (\d+)", (bundle / "serve.sh").read_text()) if (bundle / "serve.sh").is_file() else None
    return int(found.group(1)) if found else None


def read(bundle: Path, name: str) -> dict:
    if not (bundle / name).is_file():
        hint = " (bundles published before eval_prompts.json existed: publish again)" if name == PROMPTS else ""
        raise Unusable(f"{bundle} has no {name}{hint}")
    return json.loads((bundle / name).read_text())


def expected_row(report: dict, k: int) -> dict:
    """eval.json's computed acceptance of the shipped draft at K and T = 0 (accepted / drafted is the row's
    "acceptance_rate", "alpha" before eval.json's format 3)."""
    for row in report["acceptance"]:
        if row["proposer"] == report["shipped"] and row["temperature"] == 0.0 and row["k"] == k:
            return {**row, "acceptance_rate": row.get("acceptance_rate", row.get("alpha"))}
    raise Unusable(f"eval.json has no T=0 row of {report['shipped']!r} at K={k}")


def batch_and_k(spec: dict) -> tuple[int | None, int, str, dict]:
    """The most requests at once (vLLM's max_num_seqs), the K they run at, what was chosen, and the speculative
    config to load: with a K-by-batch-size schedule (num_speculative_tokens_per_batch_size), the batch sizes of its
    first range, so that every step runs at one K whose acceptance eval.json has; a schedule whose first range
    turns speculation off is left out (there is no K to compare there), and the bundle's K is checked at any batch
    size; without one, vLLM's default batch and the bundle's K."""
    k, schedule = spec["num_speculative_tokens"], spec.get("num_speculative_tokens_per_batch_size")
    if not schedule:
        return None, k, f"K={k} at every batch size", spec
    first, last, k_first = schedule[0]
    if k_first == 0:
        without = {key: value for key, value in spec.items() if key != "num_speculative_tokens_per_batch_size"}
        return None, k, f"the schedule {schedule} turns speculation off at batch sizes {first}-{last}: checked at K={k} without it", without
    return last, min(k, k_first), f"the schedule {schedule} loaded; batches of at most {last} run at K={min(k, k_first)}", spec


def dtype_of(draft: Path, report: dict) -> tuple[str, str]:
    """The dtype vLLM runs in, and why: vLLM's CPU kernels for W4A16 (compressed-tensors pack-quantized) take
    bf16 activations only; otherwise the dtype the evaluate stage computed acceptance in (eval.json's)."""
    config = json.loads((draft / "config.json").read_text())
    if config.get("quantization_config"):
        return "bfloat16", "bfloat16: vLLM's CPU W4A16 kernels take bf16 activations only"
    dtype = report.get("dtype", "float32")
    return dtype, f"{dtype}, as evaluate computed acceptance"


def spec_counters(metrics: list) -> dict:
    """vLLM's speculative-decoding counters, summed over engines."""
    out = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "per_position": []}
    for metric in metrics:
        name = metric.name.removeprefix("vllm:spec_decode_")
        if name in out and name != "per_position":
            out[name] += metric.value
        elif name == "num_accepted_tokens_per_pos":
            sums = out["per_position"] or [0] * len(metric.values)
            out["per_position"] = [a + b for a, b in zip(sums, metric.values)]
    return out


def derived(counters: dict) -> dict:
    """Acceptance by position, accepted / drafted and mean acceptance length (bonus token included)."""
    drafts = counters["num_drafts"]
    return {
        "acceptance_by_position": [a / drafts for a in counters["per_position"]] if drafts else [],
        "acceptance_rate": counters["num_accepted_tokens"] / counters["num_draft_tokens"] if counters["num_draft_tokens"] else 0.0,
        "tau": 1 + counters["num_accepted_tokens"] / drafts if drafts else 0.0,
    }


def disagreements(measured: dict, expected: dict, tolerance: float) -> list[str]:
    """Where vLLM's acceptance and eval.json's differ by more than the tolerance, with both numbers."""
    ours = expected["acceptance_by_position"]
    theirs = measured["acceptance_by_position"]
    if len(theirs) != len(ours):
        return [f"vLLM counted {len(theirs)} draft positions, eval.json has {len(ours)}"]
    return [
        f"position {i + 1}: vLLM {v:.4f}, eval.json {e:.4f} (difference {v - e:+.4f}, tolerance {tolerance})"
        for i, (v, e) in enumerate(zip(theirs, ours))
        if abs(v - e) > tolerance
    ]


def cpu_memory_share() -> dict:
    """On vLLM's CPU backend, the share of the machine's memory to claim: vLLM's default (0.92 of all of it,
    `gpu_memory_utilization` on every backend) refuses to start while other processes hold more than 8%, and the
    check needs little KV cache. Four fifths of what is free, read from /proc/meminfo; nothing on a GPU."""
    if os.environ.get("VLLM_TARGET_DEVICE") != "cpu" or not Path("/proc/meminfo").is_file():
        return {}
    kib = dict(line.split()[:2] for line in Path("/proc/meminfo").read_text().splitlines() if line.split())
    share = 0.8 * int(kib["MemAvailable:"]) / int(kib["MemTotal:"])
    return {"gpu_memory_utilization": round(min(share, 0.9), 3)}


def run_vllm(
    target: str, spec: dict, prompts: list[list[int]], max_new_tokens: int, max_len: int | None, dtype: str, max_num_seqs: int | None
) -> tuple[dict, float]:
    """Generate greedily with vLLM; its speculative-decoding counters, and the seconds it took."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    started = time.perf_counter()
    batch = {"max_num_seqs": max_num_seqs} if max_num_seqs else {}
    llm = LLM(
        model=target,
        speculative_config=spec,
        dtype=dtype,
        max_model_len=max_len,
        seed=0,
        disable_log_stats=False,
        trust_remote_code=False,
        **batch,
        **cpu_memory_share(),
    )
    llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts], SamplingParams(temperature=0.0, max_tokens=max_new_tokens), use_tqdm=False
    )
    return spec_counters(llm.get_metrics()), time.perf_counter() - started


SERVED_COUNTER = re.compile(r"^vllm:spec_decode_(num_drafts|num_draft_tokens|num_accepted_tokens(?:_per_pos)?)_total\{([^}]*)\} (\S+)$")


def served_counters(url: str) -> dict:
    """vLLM's speculative-decoding counters from a server's /metrics (Prometheus text), summed over engines."""
    from urllib.request import urlopen

    out = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "per_position": {}}
    for line in urlopen(f"{url}/metrics", timeout=30).read().decode().splitlines():
        if found := SERVED_COUNTER.match(line):
            name, labels, value = found.group(1), found.group(2), float(found.group(3))
            if name == "num_accepted_tokens_per_pos":
                position = int(re.search(r'position="(\d+)"', labels).group(1))
                out["per_position"][position] = out["per_position"].get(position, 0) + value
            else:
                out[name] += value
    out["per_position"] = [out["per_position"][i] for i in sorted(out["per_position"])]
    return out


def run_served(url: str, prompts: list[list[int]], max_new_tokens: int, at_once: int | None) -> tuple[dict, float]:
    """The prompts through a running vLLM server, greedy, at most `at_once` in flight; the counters it added."""
    from concurrent.futures import ThreadPoolExecutor
    from urllib.request import Request, urlopen

    model = json.loads(urlopen(f"{url}/v1/models", timeout=30).read())["data"][0]["id"]

    def complete(ids: list[int]) -> None:
        body = {"model": model, "prompt": ids, "max_tokens": max_new_tokens, "temperature": 0.0}
        urlopen(Request(f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}), timeout=600).read()

    before, started = served_counters(url), time.perf_counter()
    with ThreadPoolExecutor(at_once or 64) as pool:
        list(pool.map(complete, prompts))
    after = served_counters(url)
    counters = {key: after[key] - before[key] for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    earlier = before["per_position"] + [0] * (len(after["per_position"]) - len(before["per_position"]))
    counters["per_position"] = [a - b for a, b in zip(after["per_position"], earlier)]
    return counters, time.perf_counter() - started


def check(bundle: Path, target: str | None, tolerance: float, url: str | None = None) -> dict:
    shipped = read(bundle, "speculative_config.json")
    report = read(bundle, "eval.json")
    prompts = read(bundle, PROMPTS)
    max_num_seqs, k, schedule, spec = batch_and_k(shipped)
    expected = expected_row(report, k)
    if url:
        if spec is not shipped:  # the schedule was left out here; the server runs with it
            raise Unusable(f"{schedule}; a running server keeps the schedule: serve the bundle without it to check it")
        dtype, why = "the server's", "the server's dtype"
        counters, seconds = run_served(url.rstrip("/"), prompts["prompt_token_ids"], prompts["max_new_tokens"], max_num_seqs)
    else:
        spec = {**spec, "model": str(bundle / "draft")}  # the bundle's own draft, wherever the bundle is now
        dtype, why = dtype_of(bundle / "draft", report)
        counters, seconds = run_vllm(
            target, spec, prompts["prompt_token_ids"], prompts["max_new_tokens"], max_model_len(bundle), dtype, max_num_seqs
        )
    counters["per_position"] = counters["per_position"][:k]  # vLLM counts positions up to its K at start-up
    measured = derived(counters)
    return {
        "bundle": str(bundle),
        "method": spec["method"],
        "k": k,
        "schedule": schedule,
        "dtype": dtype,
        "dtype_why": why,
        "num_prompts": len(prompts["prompt_token_ids"]),
        "seconds": round(seconds, 1),
        "counters": counters,
        "vllm": measured,
        "eval_json": {key: expected[key] for key in ("acceptance_by_position", "acceptance_rate", "tau")},
        "tolerance": tolerance,
        "disagreements": disagreements(measured, expected, tolerance),
        "note": vocab_note(bundle, spec),
    }


def vocab_note(bundle: Path, spec: dict) -> str | None:
    """Where vLLM proposes from other tokens than eval.json measured: a draft model with a reduced proposal vocabulary
    (draft_vocab.json, draftsmith's own) proposes from its whole vocabulary in vLLM."""
    vocab = bundle / "draft_vocab.json"
    if spec["method"] != "draft_model" or not vocab.is_file():
        return None
    size = len(json.loads(vocab.read_text())["token_ids"])
    return (
        f"eval.json measured proposals from the {size} tokens of draft_vocab.json, as draftsmith serve makes them; vLLM's "
        "draft_model method proposes from the draft's whole vocabulary, which can keep fewer drafts"
    )


def table(result: dict) -> str:
    ours, theirs = result["eval_json"], result["vllm"]
    row = lambda name, a: f"  {name:<10} " + "  ".join(f"{x:.4f}" for x in a)
    return "\n".join(
        [
            f"  acceptance by position (K={result['k']}, T=0, {result['num_prompts']} prompts, vLLM in {result['dtype_why']}; "
            f"{result['schedule']})",
            row("vLLM", theirs["acceptance_by_position"]),
            row("eval.json", ours["acceptance_by_position"]),
            f"  accepted/drafted: vLLM {theirs['acceptance_rate']:.4f}, eval.json {ours['acceptance_rate']:.4f}; "
            f"mean acceptance length: vLLM {theirs['tau']:.4f}, eval.json {ours['tau']:.4f}",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("bundle", type=Path)
    parser.add_argument("target", nargs="?", help="the target's dir (or hub id) that the bundle speculates for")
    parser.add_argument("--url", help="check a running `vllm serve` of the bundle instead of loading it here")
    parser.add_argument("--tolerance", type=float, default=TOLERANCE, help="per-position acceptance difference allowed")
    parser.add_argument("--out", type=Path, help="write the result as JSON here")
    args = parser.parse_args(argv)
    bundle = args.bundle.resolve()
    if not args.url and not args.target:
        parser.error("give the target, or --url of a running vLLM server")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: its errors reach us whole
    # the check judges the bundle, not what earlier runs left in ~/.cache/vllm: an EAGLE-3 check that found a
    # compiled backbone it could not load recompiled and died of a stack overflow inside torch (2026-12-05)
    os.environ.setdefault("VLLM_DISABLE_COMPILE_CACHE", "1")
    try:
        version = "at " + args.url if args.url else __import__("vllm").__version__
    except ImportError as e:
        print(f"vLLM does not import here ({e}): make vllm-check installs it in .venv-vllm", file=sys.stderr)
        return 2
    try:
        result = check(bundle, args.target, args.tolerance, args.url)
    except Unusable as e:
        print(f"vllm-check: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - vLLM's message is the answer
        print(f"vLLM refused the bundle {bundle}: {type(e).__name__}: {e}")
        return 1
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    verdict = "disagrees with eval.json" if result["disagreements"] else "agrees with eval.json"
    print(
        f"vLLM {version} loaded and decoded the bundle {bundle} (method {result['method']}, "
        f"{result['seconds']:.0f} s); its acceptance {verdict}\n{table(result)}"
    )
    for line in result["disagreements"]:
        print(f"  disagreement: {line}")
    if result["note"]:
        print(f"  note: {result['note']}")
    return 1 if result["disagreements"] else 0


if __name__ == "__main__":
    sys.exit(main())
