"""The evaluate stage: acceptance on the held-out prompts for every proposer, K = 1..max, T = 0 and T > 0,
computed from one teacher-forced pass (evaluate/acceptance.py); whole-step costs and the choice of K;
then the engine itself at the chosen K, which cross-checks the computed tau and measures the speedup.

Proposers: the shipped draft (W4A16 when quantized, or the EAGLE-3 head), the bf16 distilled draft
when the shipped one is quantized, the initial draft before distillation, a hard-label-trained draft
when the sweep has one, and prompt lookup. The gates are judged after the stage, cached or not,
against the configured thresholds: a failed gate fails the job (and so blocks publishing) unless
publish.override_gates=true.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Mapping

from draftsmith.distill.data import load_prompts
from draftsmith.evaluate import cost, report as reports
from draftsmith.evaluate.acceptance import acceptance, computed_rows, measure, references
from draftsmith.evaluate.report import rows_of
from draftsmith.pipeline.config import DraftsmithConfig, EvaluateConfig
from draftsmith.pipeline.stage import Stage, StageOutput, read_record
from draftsmith.pipeline.target import load_reference
from draftsmith.quantize.stage import draft_dir_of
from draftsmith.serve.device import compute_dtype, pick_device
from draftsmith.serve.engine import Engine, detokenizer_of, eos_ids_of, load_draft
from draftsmith.serve.proposers import PromptLookup, read_vocab
from draftsmith.serve.sampling import SamplingParams
from draftsmith.serve.weights import load_model

PROMPT_LOOKUP = "prompt_lookup"
EVAL_PROMPTS = "eval_prompts.json"  # the held-out prompts' token ids, shipped in the bundle
log = logging.getLogger("draftsmith")


class GateFailed(RuntimeError):
    """The evaluated draft misses a configured gate; publishing is blocked unless overridden."""


def draft_kind(distill: StageOutput) -> str:
    return distill.record["config"]["draft"].get("kind", "standalone")


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
    quantized = shipped != distill.path / "draft"
    name = "eagle3" if draft_kind(distill) == "eagle3" else "w4a16" if quantized else "bf16"
    dirs = {name: shipped, **({"bf16": distill.path / "draft"} if quantized else {}), "initial": distill.path / "initial"}
    if distill.record["config"]["distill"]["loss"] != "hard_label" and (sibling := hard_label_sibling(distill)):
        dirs["hard_label"] = sibling
    return dirs


def same_shape(a, b) -> bool:
    """Two drafts whose steps cost the same: one kind, one architecture, one proposal vocabulary (the
    runtime dequantizes a W4A16 draft at load, and an untrained draft has its trained twin's shape)."""
    if a is None or b is None or type(a) is not type(b) or a.args != b.args or getattr(a, "shape", None) != getattr(b, "shape", None):
        return False
    va, vb = getattr(a, "vocab", None), getattr(b, "vocab", None)
    return (va is None) == (vb is None) and (va is None or va.shape == vb.shape)


def gates(e: EvaluateConfig, report: dict) -> dict:
    """The gates on a report, against the configured thresholds (which are not part of the measurement,
    so changing them re-runs no evaluation): the shipped draft's alpha, the probability that the target
    keeps one drafted token (K = 1, T = 0; the fraction of drafts kept falls with K, so a gate on it would
    refuse the longer K that measured faster), and, when it is quantized, its tau loss against bf16 at the
    chosen K and T = 0."""
    shipped, k = report["shipped"], report["num_speculative_tokens"]
    alpha = rows_of(report, shipped, 0.0)[1]["alpha"]
    result: dict[str, Any] = {"min_alpha": {"threshold": e.min_alpha, "value": alpha, "passed": alpha >= e.min_alpha,
                                            "what": f"alpha of {shipped} (a draft kept, K=1, T=0)"}}
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
    dirs, vocab = draft_dirs(inputs), read_vocab(inputs["distill"].path)
    shipped = next(iter(dirs))
    target = load_model(target_dir, dtype, device)
    longest = max(len(p) for p in prompts) + e.max_new_tokens + e.max_speculative_tokens + 2
    # CUDA graphs on a GPU, without torch.compile: compiling every proposer's engine costs more than it tells
    engine_of = lambda draft=None: Engine(target, draft, max_batch_size=e.batch_size, max_seq_len=longest, compile_blocks=False,
                                          eos_token_ids=eos_ids_of(target_dir), detokenize=detokenizer_of(target_dir))
    k_max, temperatures = e.max_speculative_tokens, [0.0, e.temperature]
    params = {t: SamplingParams(temperature=t, seed=e.seed, max_new_tokens=e.max_new_tokens) for t in temperatures}
    names = [*dirs, PROMPT_LOOKUP]
    computed, step_ms = [], {}
    with Progress() as progress:
        task = progress.add_task("evaluate", total=len(temperatures) * 2 + len(names) + 2)
        progress.update(task, description="the target's continuations")
        plain = engine_of()
        refs = {t: references(plain, prompts, params[t], k_max) for t in temperatures}
        plain_ms = plain.time_step(e.batch_size, 0)
        progress.advance(task, len(temperatures))
        drafts = {name: load_draft(dirs[name], dtype, device, vocab) if name in dirs else None for name in names}
        for t in temperatures:
            progress.update(task, description=f"acceptance of every proposer, T={t:g}")
            for name, accepts in acceptance(target, drafts, refs[t], params[t], k_max, e.batch_size).items():
                computed += computed_rows(name, t, accepts, refs[t], k_max)
            progress.advance(task)
        for name, draft in drafts.items():
            progress.update(task, description=f"step costs: {name}")
            same = next((other for other in step_ms if same_shape(drafts[other], draft)), None)
            if same is not None:  # a W4A16 draft runs dequantized: its steps cost what its bf16 twin's cost
                step_ms[name] = step_ms[same]
                progress.advance(task)
                continue
            # an engine per proposer, each with its own KV caches and graphs; dropped after its timings but
            # the shipped draft's (the first proposer, so always timed here), which measures its speed below
            engine = engine_of(draft)
            proposer = PromptLookup(target.args.vocab_size) if draft is None else None
            step_ms[name] = {k: engine.time_step(e.batch_size, k, proposer=proposer) for k in range(1, k_max + 1)}
            progress.advance(task)
            if name == shipped:
                shipped_engine = engine
            del engine
            if device == "cuda":
                torch.cuda.empty_cache()
        report = {"acceptance": [c.as_dict() for c in computed]}
        tau = lambda name, k: rows_of(report, name, 0.0)[k]["tau"]
        predicted = {name: {k: cost.predicted_speedup(tau(name, k), plain_ms, ms) for k, ms in step_ms[name].items()} for name in names}
        k, why = cost.choose_k(predicted[shipped])
        # the engine at the chosen K: the speed measurement, and the check of the computed counters
        progress.update(task, description=f"engine: plain and {shipped} K={k}")
        # plain decoding on the references' engine, the draft on its step-cost engine
        if device == "cuda":  # a first, untimed pass captures every shape's CUDA graphs (prefills, steps)
            measure(plain, "plain", prompts, params[0.0], 0)
            measure(shipped_engine, shipped, prompts, params[0.0], k)
        # plain and speculative in turns, speed_repeats times each; the medians: one slow run (the machine
        # busy with something else) moves neither
        runs = [(measure(plain, "plain", prompts, params[0.0], 0), measure(shipped_engine, shipped, prompts, params[0.0], k))
                for _ in range(e.speed_repeats)]
        median_run = lambda i: sorted((r[i] for r in runs), key=lambda m: m.tokens_per_s)[(len(runs) - 1) // 2]
        plain_run, shipped_run = median_run(0), median_run(1)
        measured_speedup = shipped_run.tokens_per_s / plain_run.tokens_per_s
        # a step emits tau tokens and costs at least a plain step: a speedup above tau means something else
        # took the machine during the runs
        disturbed = k > 0 and measured_speedup > shipped_run.stats.tau
        if disturbed:
            log.warning("evaluate: measured speedup %.2fx is above tau %.3f, which bounds it: the machine was busy "
                        "with something else; reporting tau as the speedup", measured_speedup, shipped_run.stats.tau)
            measured_speedup = shipped_run.stats.tau
        progress.advance(task, 2)
    computed_tau = tau(shipped, k)
    data = inputs["data"]
    report = {
        "format_version": 2, "device": device, "dtype": str(dtype).removeprefix("torch."),
        "eval_split": {"data_fingerprint": data.fingerprint, "eval_ids_sha256": data.metrics.get("eval_ids_sha256"),
                       "num_prompts": len(prompts), "max_new_tokens": e.max_new_tokens},
        "temperatures": temperatures, "seed": e.seed, "max_speculative_tokens": k_max,
        "shipped": shipped, "kind": draft_kind(inputs["distill"]),
        # where each came from, relative to the run root: the report travels in the bundle
        "proposers": {name: str(dirs[name].relative_to(inputs["distill"].path.parents[1])) if name in dirs
                      else "n-gram lookup in the sequence so far" for name in names},
        "draft_vocab_size": len(vocab) if vocab else None,
        "acceptance": report["acceptance"],
        "engine": [plain_run.as_dict(), shipped_run.as_dict()],
        "cross_check": {"proposer": shipped, "k": k, "temperature": 0.0, "computed_tau": computed_tau,
                        "measured_tau": shipped_run.stats.tau, "difference": shipped_run.stats.tau - computed_tau,
                        "outputs_equal_plain": shipped_run.outputs == plain_run.outputs},
        "speed": {"batch_size": e.batch_size, "plain_step_ms": round(plain_ms, 4),
                  "step_ms": {name: {str(k_): round(v, 4) for k_, v in s.items()} for name, s in step_ms.items()},
                  "predicted_speedup": {name: {str(k_): round(v, 4) for k_, v in s.items()} for name, s in predicted.items()},
                  "measured_speedup": {shipped: {str(k): round(measured_speedup, 4)}}, "disturbed": disturbed,
                  "runs_tokens_per_s": {"plain": [round(r[0].tokens_per_s, 2) for r in runs],
                                        shipped: [round(r[1].tokens_per_s, 2) for r in runs]},
                  "plain_tokens_per_s": round(plain_run.tokens_per_s, 2), "tokens_per_s": round(shipped_run.tokens_per_s, 2)},
        "num_speculative_tokens": k, "why": why,
    }
    reports.write_all(report, out)
    # what vLLM decodes to check the bundle (pipeline/vllm_check.py): the same token ids, the same length
    (out / EVAL_PROMPTS).write_text(json.dumps({"prompt_token_ids": prompts, "max_new_tokens": e.max_new_tokens}))
    tau5 = {name: tau(name, 5) for name in names if 5 <= k_max}
    chosen = rows_of(report, shipped, 0.0)[k]
    return {"num_speculative_tokens": k, "alpha": rows_of(report, shipped, 0.0)[1]["alpha"], "tau": chosen["tau"],
            "acceptance_rate": chosen["alpha"], "shipped": shipped,
            "kind": report["kind"], **{f"tau_k5_{name}": v for name, v in tau5.items()},
            "tau_k5_distilled_over_initial": tau5[shipped] / tau5["initial"] if tau5 else None,
            "predicted_speedup": predicted[shipped][k], "measured_speedup": measured_speedup,
            "measured_tau": shipped_run.stats.tau, "tau_difference": shipped_run.stats.tau - computed_tau}


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
