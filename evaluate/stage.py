"""The evaluate stage: acceptance on the held-out prompts for every proposer, K = 1..max and T = 0 and
T > 0, through the engine's speculative loop; the cost model and the choice of K; gates; reports.

Proposers: the shipped draft (W4A16 when quantized), the bf16 distilled draft, the initial draft
before distillation, a hard-label-trained draft when the sweep has one, and prompt lookup.
The gates are judged after the stage, cached or not, against the configured thresholds: a failed gate
fails the job (and so blocks publishing) unless publish.override_gates=true.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from draftsmith.distill.data import load_prompts
from draftsmith.evaluate import cost, report as reports
from draftsmith.evaluate.report import rows_of
from draftsmith.evaluate.acceptance import Measurement, measure
from draftsmith.pipeline.config import DraftsmithConfig, EvaluateConfig
from draftsmith.pipeline.stage import Stage, StageOutput, read_record
from draftsmith.pipeline.target import load_reference
from draftsmith.quantize.stage import draft_dir_of
from draftsmith.serve.engine import Engine, compute_dtype, detokenizer_of, eos_ids_of, pick_device
from draftsmith.serve.proposers import PromptLookup
from draftsmith.serve.sampling import SamplingParams
from draftsmith.serve.weights import load_model

PROMPT_LOOKUP = "prompt_lookup"


class GateFailed(RuntimeError):
    """The evaluated draft misses a configured gate; publishing is blocked unless overridden."""


def hard_label_sibling(distill: StageOutput) -> Path | None:
    """A draft of the same sweep trained with the hard-label loss on the same teacher data, if any."""
    own = distill.record
    for sibling in sorted(distill.path.parent.iterdir()):
        record = read_record(sibling)
        if record is None or sibling == distill.path:
            continue
        same_teacher = record["inputs"]["teacher"]["fingerprint"] == own["inputs"]["teacher"]["fingerprint"]
        same_draft = record["config"]["draft"] == own["config"]["draft"]
        if same_teacher and same_draft and record["config"]["distill"]["loss"] == "hard_label":
            return sibling / "draft"
    return None


def draft_dirs(inputs: Mapping[str, StageOutput]) -> dict[str, Path]:
    """name -> draft dir of every model proposer; the first is the one publish ships."""
    distill, quantize = inputs["distill"], inputs["quantize"]
    shipped = draft_dir_of(distill, quantize)
    dirs = {"w4a16" if shipped != distill.path / "draft" else "bf16": shipped, "bf16": distill.path / "draft",
            "initial": distill.path / "initial"}
    if distill.record["config"]["distill"]["loss"] != "hard_label" and (sibling := hard_label_sibling(distill)):
        dirs["hard_label"] = sibling
    return dirs


def gates(e: EvaluateConfig, report: dict) -> dict:
    """The gates on a report, against the configured thresholds (which are not part of the measurement,
    so changing them re-runs no evaluation): alpha of the shipped draft and, when it is quantized,
    its tau loss against bf16, both at the chosen K and T = 0."""
    shipped, k = report["shipped"], report["num_speculative_tokens"]
    alpha = rows_of(report, shipped, 0.0)[k]["alpha"]
    result: dict[str, Any] = {"min_alpha": {"threshold": e.min_alpha, "value": alpha, "passed": alpha >= e.min_alpha,
                                            "what": f"acceptance rate of {shipped} at K={k}, T=0"}}
    if shipped == "w4a16":
        bf16, w4 = rows_of(report, "bf16", 0.0)[k]["tau"], rows_of(report, "w4a16", 0.0)[k]["tau"]
        loss = (bf16 - w4) / bf16
        result["max_tau_loss"] = {"threshold": e.max_tau_loss, "value": loss, "passed": loss <= e.max_tau_loss,
                                  "what": f"relative tau loss of the W4A16 draft against bf16 at K={k}, T=0"}
    else:
        result["max_tau_loss"] = {"threshold": e.max_tau_loss, "value": None, "passed": True, "what": "no quantized draft"}
    result["passed"] = all(g["passed"] for g in result.values())
    return result


def with_gates(cfg: DraftsmithConfig, evaluation: StageOutput) -> dict:
    """The evaluate stage's eval.json with the gates judged against cfg's thresholds."""
    report = json.loads((evaluation.path / "eval.json").read_text())
    return {**report, "gates": gates(cfg.evaluate, report)}


def run(cfg: DraftsmithConfig, inputs: Mapping[str, StageOutput], out: Path) -> dict[str, Any]:
    import torch
    from rich.progress import Progress

    e = cfg.evaluate
    target_dir = Path(load_reference(inputs["target"])["path"])
    device = pick_device(cfg.device.value)
    dtype = compute_dtype(cfg.target.dtype.value, device)
    prompts = [r["prompt_ids"] for r in load_prompts(inputs["data"]).to_list() if r["split"] == "eval"][: e.num_prompts]
    if not prompts:
        raise ValueError("the data stage has no held-out prompts: raise data.eval_fraction")
    dirs = draft_dirs(inputs)
    shipped = next(iter(dirs))
    target = load_model(target_dir, dtype, device)
    longest = max(len(p) for p in prompts) + e.max_new_tokens + e.max_speculative_tokens + 2
    # CUDA graphs on a GPU, without torch.compile: compiling every proposer's engine costs more than it tells
    engine_of = lambda draft: Engine(target, draft, max_batch_size=e.batch_size, max_seq_len=longest, compile_blocks=False,
                                     eos_token_ids=eos_ids_of(target_dir), detokenize=detokenizer_of(target_dir))
    temperatures = [0.0, e.temperature]
    ks = range(1, e.max_speculative_tokens + 1)
    names = [*dirs, PROMPT_LOOKUP]
    measured: dict[tuple[str, float, int], Measurement] = {}
    draft_ms: dict[str, float] = {}
    plain = engine_of(None)
    target_ms = cost.time_forward(plain.target_forward, e.batch_size, 1, plain.device)
    verify_ms = {k: cost.time_forward(plain.target_forward, e.batch_size, k + 1, plain.device) for k in ks}
    with Progress() as progress:
        task = progress.add_task("evaluate", total=(len(names) * len(ks) + 1) * len(temperatures))
        for t in temperatures:
            params = SamplingParams(temperature=t, seed=e.seed, max_new_tokens=e.max_new_tokens)
            measured[("plain", t, 0)] = measure(plain, "plain", prompts, params, 0)
            progress.advance(task)
        for name in names:
            # a fresh engine per proposer: engines share the target, and each one's setup replaces the
            # target's KV cache (and CUDA graphs captured on it), so an engine is never reused after another
            engine = engine_of(load_model(dirs[name], dtype, device) if name in dirs else None)
            proposer = PromptLookup(target.args.vocab_size) if name == PROMPT_LOOKUP else None
            draft_ms[name] = cost.time_forward(engine.draft_forward, e.batch_size, 1, engine.device) if name in dirs else 0.0
            for t in temperatures:
                params = SamplingParams(temperature=t, seed=e.seed, max_new_tokens=e.max_new_tokens)
                for k in ks:
                    progress.update(task, description=f"{name} T={t:g} K={k}")
                    measured[(name, t, k)] = measure(engine, name, prompts, params, k, proposer)
                    progress.advance(task)
            del engine
            if device == "cuda":
                torch.cuda.empty_cache()

    costs = {name: cost.StepCosts(e.batch_size, target_ms, draft_ms[name], verify_ms) for name in names}
    plain_rate = measured[("plain", 0.0, 0)].tokens_per_s
    measured_speedup = {name: {k: measured[(name, 0.0, k)].tokens_per_s / plain_rate for k in ks} for name in names}
    predicted = {name: {k: cost.predicted_speedup(measured[(name, 0.0, 1)].stats.acceptance_rate, k, costs[name]) for k in ks}
                 for name in names}
    k, why = cost.choose_k(measured_speedup[shipped], predicted[shipped])
    data = inputs["data"]
    report = {
        "format_version": 1, "device": device, "dtype": str(dtype).removeprefix("torch."),
        "eval_split": {"data_fingerprint": data.fingerprint, "eval_ids_sha256": data.metrics.get("eval_ids_sha256"),
                       "num_prompts": len(prompts), "max_new_tokens": e.max_new_tokens},
        "temperatures": temperatures, "seed": e.seed, "max_speculative_tokens": e.max_speculative_tokens,
        "shipped": shipped, "proposers": {name: str(dirs.get(name, "n-gram lookup in the sequence so far")) for name in names},
        "acceptance": [{key: v for key, v in m.as_dict().items() if key != "seconds"} for m in measured.values()],
        "speed": {"costs": {name: c.as_dict() for name, c in costs.items()},
                  "tokens_per_s": [{"proposer": m.proposer, "temperature": m.temperature, "k": m.k,
                                    "tokens_per_s": round(m.tokens_per_s, 2)} for m in measured.values()],
                  "measured_speedup": {name: {str(k): round(v, 4) for k, v in s.items()} for name, s in measured_speedup.items()},
                  "predicted_speedup": {name: {str(k): round(v, 4) for k, v in s.items()} for name, s in predicted.items()}},
        "num_speculative_tokens": k, "why": why,
    }
    reports.write_all(report, out)
    tau5 = {name: measured[(name, 0.0, 5)].stats.tau for name in names if 5 in ks}
    chosen = measured[(shipped, 0.0, k)].stats
    return {"num_speculative_tokens": k, "alpha": chosen.acceptance_rate, "tau": chosen.tau, "shipped": shipped,
            **{f"tau_k5_{name}": v for name, v in tau5.items()},
            "tau_k5_distilled_over_initial": tau5["bf16"] / tau5["initial"] if tau5 else None,
            "measured_speedup": measured_speedup[shipped][k]}


def check_gates(cfg: DraftsmithConfig, output: StageOutput) -> None:
    gate = with_gates(cfg, output)["gates"]
    failed = [f"{name} ({g['what']}: {g['value']:.4f} against {g['threshold']})" for name, g in gate.items()
              if isinstance(g, dict) and not g["passed"]]
    if failed and not cfg.publish.override_gates:
        raise GateFailed("evaluation gate failed: " + "; ".join(failed) + f". Report: {output.path / 'eval.md'}. "
                         "Publishing is blocked; distil a better draft, relax evaluate.min_alpha / evaluate.max_tau_loss, "
                         "or publish anyway with publish.override_gates=true")


MEASUREMENT_KEYS = tuple(f"evaluate.{key}" for key in ("num_prompts", "batch_size", "max_new_tokens", "max_speculative_tokens",
                                                      "temperature", "seed"))
STAGE = Stage(name="evaluate", config_keys=MEASUREMENT_KEYS, inputs=("target", "data", "distill", "quantize"), run=run,
              check=check_gates, artifacts=("eval.json", "eval.md", *reports.PLOTS))
