"""The evaluate stage: acceptance on the held-out prompts for every proposer, K = 1..max, T = 0 and T > 0,
computed from one teacher-forced pass (evaluate/acceptance.py); whole-step costs and the choice of K;
the engine itself at the chosen K, which cross-checks the computed tau and measures the speedup; and the
K that pays at each batch size (what vLLM's dynamic speculation reads from the bundle).

Proposers: the shipped draft (W4A16 when quantized, or the EAGLE-3 head), the bf16 distilled draft
when the shipped one is quantized, the initial draft before distillation, and prompt lookup. The gates
are judged after the stage, cached or not, against the configured thresholds: a failed gate fails the
job (and so blocks publishing) unless publish.override_gates=true.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

from draftsmith.distill.data import load_prompts
from draftsmith.evaluate import cost
from draftsmith.evaluate import report as reports
from draftsmith.evaluate.acceptance import Computed, Measurement, acceptance, computed_rows, lookup_first, measure, references
from draftsmith.evaluate.report import EvalReport, Speed, read_report
from draftsmith.pipeline.config import DraftsmithConfig, EvaluateConfig
from draftsmith.pipeline.stage import Stage, StageOutput
from draftsmith.pipeline.target import load_reference
from draftsmith.quantize.stage import draft_dir_of
from draftsmith.serve.device import compute_dtype, pick_device
from draftsmith.serve.engine import Engine, detokenizer_of, eos_ids_of, load_draft
from draftsmith.serve.proposers import PromptLookup, read_vocab
from draftsmith.serve.sampling import SamplingParams
from draftsmith.serve.transformers_model import load_any

EVAL_PROMPTS = "eval_prompts.json"  # the held-out prompts' token ids, shipped in the bundle
GATE_KEYS = ("evaluate.min_alpha", "evaluate.alpha_gate", "evaluate.max_tau_loss", "evaluate.min_speedup")  # judged after the stage
log = logging.getLogger("draftsmith")
LOOKUP_FIRST_MATCH = 3  # the tokens a row's text must end in, earlier in it, for its lookup row (serve's default to suggest)


class GateFailed(RuntimeError):
    """The evaluated draft misses a configured gate; publishing is blocked unless overridden."""


def draft_kind(distill: StageOutput) -> str:
    return distill.record["config"]["draft"].get("kind", "standalone")


def draft_dirs(inputs: Mapping[str, StageOutput]) -> dict[str, Path]:
    """name -> draft dir of every model proposer; the first is the one publish ships."""
    distill, quantize = inputs["distill"], inputs["quantize"]
    shipped = draft_dir_of(distill, quantize)
    quantized = shipped != distill.path / "draft"
    name = "eagle3" if draft_kind(distill) == "eagle3" else "w4a16" if quantized else "bf16"
    return {name: shipped, **({"bf16": distill.path / "draft"} if quantized else {}), cost.INITIAL: distill.path / "initial"}


def same_shape(a, b) -> bool:
    """Two drafts whose steps cost the same: one kind, one architecture, one proposal vocabulary (the
    runtime dequantizes a W4A16 draft at load, and an untrained draft has its trained twin's shape)."""
    if a is None or b is None or type(a) is not type(b) or a.args != b.args or getattr(a, "shape", None) != getattr(b, "shape", None):
        return False
    va, vb = getattr(a, "vocab", None), getattr(b, "vocab", None)
    return (va is None) == (vb is None) and (va is None or va.shape == vb.shape)


def gates(e: EvaluateConfig, report: dict) -> dict:
    """The gates on a report, against the configured thresholds (which are not part of the measurement,
    so changing them re-runs no evaluation): the shipped draft's alpha (K = 1, T = 0; the acceptance rate
    falls with K, so a gate on it would refuse the longer K that measured faster), and, when it is
    quantized, its tau loss against bf16 at the chosen K and T = 0. The alpha gate holds a draft back only as
    a hard gate (evaluate.alpha_gate=hard); by default a draft below it is published with a warning, since what
    users feel is its measured speed. "passed": every hard gate passed; "warnings": the soft ones that did not."""
    shipped, k = report["shipped"], report["num_speculative_tokens"]
    alpha = reports.rows_of(report, shipped, 0.0)[1]["acceptance_rate"]
    result: dict[str, Any] = {
        "min_alpha": {
            "threshold": e.min_alpha,
            "value": alpha,
            "passed": alpha >= e.min_alpha,
            "hard": e.alpha_gate == "hard",
            "what": f"alpha of {shipped} (a draft kept, K=1, T=0)",
        }
    }
    if shipped == "w4a16":
        bf16, w4 = (reports.rows_of(report, name, 0.0)[k]["tau"] for name in ("bf16", "w4a16"))
        loss = (bf16 - w4) / bf16
        result["max_tau_loss"] = {
            "threshold": e.max_tau_loss,
            "value": loss,
            "passed": loss <= e.max_tau_loss,
            "hard": True,
            "what": f"relative tau loss of the W4A16 draft against bf16 at K={k}, T=0",
        }
    else:
        result["max_tau_loss"] = {"threshold": e.max_tau_loss, "value": None, "passed": True, "hard": True, "what": "no quantized draft"}
    result["warnings"] = [name for name, g in result.items() if not g["passed"] and not g["hard"]]
    result["passed"] = all(g["passed"] or not g["hard"] for name, g in result.items() if name != "warnings")
    return result


def gate_failures(gate: dict, hard: bool) -> list[str]:
    """The gates that did not pass, hard or soft ones, each with its value and threshold."""
    return [
        f"{name} ({g['what']}: {g['value']:.4f} against {g['threshold']})"
        for name, g in gate.items()
        if isinstance(g, dict) and not g["passed"] and g["hard"] == hard
    ]


def with_gates(cfg: DraftsmithConfig, evaluation: StageOutput) -> dict:
    """The evaluate stage's eval.json with the gates judged against cfg's thresholds."""
    report = read_report(evaluation.path / "eval.json")
    return {**report, "gates": gates(cfg.evaluate, report)}


@dataclass
class Evaluation:
    """What every step reads: the settings, the target on its device, and the held-out prompts."""

    e: EvaluateConfig
    device: str
    dtype: torch.dtype
    target_dir: Path
    target: Any  # serve.model.Transformer
    prompts: list[list[int]]

    def engine(self, draft=None, max_batch_size: int | None = None) -> Engine:
        """An engine over the target and `draft`, with CUDA graphs on a GPU and no torch.compile: compiling every
        proposer's engine costs more than it tells."""
        longest = max(len(p) for p in self.prompts) + self.e.max_new_tokens + self.e.max_speculative_tokens + 2
        return Engine(
            self.target,
            draft,
            max_batch_size=max_batch_size or self.e.batch_size,
            max_seq_len=longest,
            compile_blocks=False,
            eos_token_ids=eos_ids_of(self.target_dir),
            detokenize=detokenizer_of(self.target_dir),
        )

    def params(self, temperature: float) -> SamplingParams:
        return SamplingParams(temperature=temperature, seed=self.e.seed, max_new_tokens=self.e.max_new_tokens)

    def free(self) -> None:
        if self.device == "cuda":
            torch.cuda.empty_cache()


def held_out_prompts(e: EvaluateConfig, data: StageOutput) -> list[list[int]]:
    prompts = [r["prompt_ids"] for r in load_prompts(data).to_list() if r["split"] == "eval"][: e.num_prompts]
    if not prompts:
        raise ValueError("the data stage has no held-out prompts: raise data.eval_fraction")
    return prompts


def computed_acceptance(
    ev: Evaluation, plain: Engine, drafts: dict[str, Any], shipped: str, temperatures: list[float], progress, task
) -> list[Computed]:
    """Every proposer's acceptance at every K and temperature, from the target's continuations (plain
    decoding) and one teacher-forced pass each; and the shipped draft's with prompt lookup first, from its and
    the lookup's (no step costs: its speed depends on the batch, `bench decode --lookup` measures it)."""
    k_max, rows = ev.e.max_speculative_tokens, []
    for t in temperatures:
        progress.update(task, description=f"the target's continuations and every proposer's acceptance, T={t:g}")
        refs = references(plain, ev.prompts, ev.params(t), k_max)
        accepts = acceptance(ev.target, drafts, refs, ev.params(t), k_max, ev.e.batch_size)
        for name, accept in accepts.items():
            rows += computed_rows(name, t, accept, refs, k_max)
        mixed = lookup_first(accepts[shipped], accepts[cost.PROMPT_LOOKUP], refs, LOOKUP_FIRST_MATCH)
        rows += computed_rows(cost.LOOKUP_FIRST, t, mixed, refs, k_max)
        progress.advance(task)
    return rows


def timed_steps(engine: Engine, batch: int, k_max: int, what: str, proposer=None) -> dict[int, float]:
    """Whole steps at K = 0..k_max (0: plain), timed in turns (Engine.time_steps), with a warning where a
    speculative step came out faster than a plain one (cost.faster_than_plain)."""
    ms = engine.time_steps(batch, range(k_max + 1), proposer=proposer)
    if fast := cost.faster_than_plain(ms):
        log.warning(
            "evaluate: %s at batch %d: steps at K=%s timed faster than a plain step (%.3f ms): either something else "
            "had the %s while they were timed (evaluate on an idle device) or the plain step took a slow path of its "
            "own; the K chosen from these times may not pay",
            what,
            batch,
            ",".join(map(str, fast)),
            ms[0],
            engine.device.type,
        )
    return ms


def step_costs(ev: Evaluation, drafts: dict[str, Any], shipped: str, progress, task) -> tuple[dict[str, dict[int, float]], Engine]:
    """Milliseconds of a whole step of each proposer at K = 0..max (0: plain decoding, timed in the same turns)
    at the evaluation batch size, and the shipped draft's engine (kept: it measures the speed next). Drafts of
    one shape are timed once (a W4A16 draft runs dequantized: its steps cost what its bf16 twin's cost)."""
    step_ms: dict[str, dict[int, float]] = {}
    for name, draft in drafts.items():
        progress.update(task, description=f"step costs: {name}")
        same = next((other for other in step_ms if same_shape(drafts[other], draft)), None)
        if same is not None:
            step_ms[name] = step_ms[same]
        else:
            engine = ev.engine(draft)
            proposer = PromptLookup(ev.target.args.vocab_size) if draft is None else None
            step_ms[name] = timed_steps(engine, ev.e.batch_size, ev.e.max_speculative_tokens, name, proposer)
            if name == shipped:
                shipped_engine = engine
            del engine
            ev.free()
        progress.advance(task)
    return step_ms, shipped_engine


def engine_speed(
    ev: Evaluation, plain: Engine, shipped: str, shipped_engine: Engine, k: int
) -> tuple[Measurement, Measurement, list, bool, float]:
    """Plain decoding and the shipped draft at K through the continuous-batching scheduler, in turns,
    evaluate.speed_repeats times each: (median plain run, median speculative run, every run, disturbed, speedup).
    The medians: one slow run (the machine busy with something else) moves neither."""
    greedy = ev.params(0.0)
    if ev.device == "cuda":  # a first, untimed pass captures every shape's CUDA graphs (prefills, steps)
        measure(plain, "plain", ev.prompts, greedy, 0)
        measure(shipped_engine, shipped, ev.prompts, greedy, k)
    runs = [
        (measure(plain, "plain", ev.prompts, greedy, 0), measure(shipped_engine, shipped, ev.prompts, greedy, k))
        for _ in range(ev.e.speed_repeats)
    ]
    median_run = lambda i: sorted((r[i] for r in runs), key=lambda m: m.tokens_per_s)[(len(runs) - 1) // 2]
    plain_run, shipped_run = median_run(0), median_run(1)
    speedup = shipped_run.tokens_per_s / plain_run.tokens_per_s
    # a step emits tau tokens and costs at least a plain step: a speedup above tau means something else
    # took the machine during the runs
    disturbed = k > 0 and speedup > shipped_run.stats.tau
    if disturbed:
        log.warning(
            "evaluate: measured speedup %.2fx is above tau %.3f, which bounds it: the machine was busy "
            "with something else; reporting tau as the speedup",
            speedup,
            shipped_run.stats.tau,
        )
        speedup = shipped_run.stats.tau
    return plain_run, shipped_run, runs, disturbed, speedup


def k_by_batch_size(ev: Evaluation, draft, tau: dict[int, float], measured: dict[int, float], k_cap: int) -> dict[str, Any]:
    """The K that pays at each of evaluate.dynamic_k_batch_sizes: whole steps timed at K = 0..max on an engine
    with that many rows (at the evaluation batch size, the step costs K was chosen from: `measured`, K -> ms,
    0 plain), the predicted speedup tau(K) x plain step / step, the best K (0 where none beats plain decoding),
    and the schedule vLLM's dynamic speculation reads (num_speculative_tokens_per_batch_size: inclusive
    batch-size ranges, K at most the bundle's num_speculative_tokens, which vLLM caps it to)."""
    sizes = sorted({1, ev.e.batch_size, *ev.e.dynamic_k_batch_sizes})
    engine = ev.engine(draft, max_batch_size=max(sizes))
    step_ms = {
        b: measured if b == ev.e.batch_size else timed_steps(engine, b, ev.e.max_speculative_tokens, "the shipped draft") for b in sizes
    }
    del engine
    ev.free()
    predicted = {b: cost.predicted_speedups(tau, ms) for b, ms in step_ms.items()}
    best = {b: (k if speedups[k] > 1.0 else 0) for b, speedups in predicted.items() for k in [cost.choose_k(speedups)[0]]}
    schedule = []
    for i, b in enumerate(sizes):
        k = min(best[b], k_cap)
        end = sizes[i + 1] - 1 if i + 1 < len(sizes) else max(sizes)
        if schedule and schedule[-1][2] == k:
            schedule[-1][1] = end
        else:
            schedule.append([b, end, k])
    return {"batch_sizes": sizes, "step_ms": step_ms, "predicted_speedup": predicted, "best_k": best, "schedule": schedule}


def proposer_sources(dirs: dict[str, Path], names: list[str], root: Path) -> dict[str, str]:
    """Where each proposer of the report came from (a draft's dir relative to the run root: the report travels in
    the bundle); the first of `dirs` is the shipped draft."""
    shipped = next(iter(dirs))
    return {
        **{name: str(dirs[name].relative_to(root)) if name in dirs else "n-gram lookup in the sequence so far" for name in names},
        cost.LOOKUP_FIRST: f"{shipped}, with prompt lookup first where the last {LOOKUP_FIRST_MATCH} tokens occurred earlier "
        f"(draftsmith serve --lookup-first {LOOKUP_FIRST_MATCH})",
    }


def run(cfg: DraftsmithConfig, inputs: Mapping[str, StageOutput], out: Path) -> dict[str, Any]:
    from rich.progress import Progress

    e = cfg.evaluate
    device = pick_device(cfg.device.value)
    reference = load_reference(inputs["target"])
    target_dir = Path(reference["path"])
    dtype = compute_dtype(cfg.target.dtype.value, device)
    if reference.get("runtime") == "transformers":
        log.warning(
            "evaluate: the target runs through transformers (target.fallback): its step costs, and the K chosen from them, are that fallback's"
        )
    ev = Evaluation(e, device, dtype, target_dir, load_any(target_dir, dtype, device), held_out_prompts(e, inputs["data"]))
    dirs, vocab = draft_dirs(inputs), read_vocab(inputs["distill"].path)
    shipped = next(iter(dirs))
    names = [*dirs, cost.PROMPT_LOOKUP]
    temperatures = [0.0, e.temperature]
    drafts = {name: load_draft(dirs[name], dtype, device, vocab, fallback=True) if name in dirs else None for name in names}
    with Progress() as progress:
        task = progress.add_task("evaluate", total=len(temperatures) + len(names) + 2)
        plain = ev.engine()
        rows = computed_acceptance(ev, plain, drafts, shipped, temperatures, progress, task)
        step_ms, shipped_engine = step_costs(ev, drafts, shipped, progress, task)
        tau = lambda name: {r.k: r.tau for r in rows if r.proposer == name and r.temperature == 0.0}
        predicted = {name: cost.predicted_speedups(tau(name), step_ms[name]) for name in names}
        k, why = cost.choose_k(predicted[shipped])
        for note in cost.faster_notes(predicted, shipped):  # eval.md names them too
            log.warning("evaluate: %s", note)
        progress.update(task, description=f"engine: plain and {shipped} K={k}")
        plain_run, shipped_run, runs, disturbed, speedup = engine_speed(ev, plain, shipped, shipped_engine, k)
        progress.advance(task)
        del shipped_engine, plain
        progress.update(task, description="the K that pays at each batch size")
        dynamic = k_by_batch_size(ev, drafts[shipped], tau(shipped), step_ms[shipped], k)
        progress.advance(task)
    data = inputs["data"]
    speed = Speed(
        e.batch_size,
        step_ms[shipped][0],
        step_ms,
        predicted,
        {shipped: {k: speedup}},
        disturbed,
        cost.faster_than_plain(step_ms[shipped]),
        {"plain": [r[0].tokens_per_s for r in runs], shipped: [r[1].tokens_per_s for r in runs]},
        plain_run.tokens_per_s,
        shipped_run.tokens_per_s,
    )
    report = EvalReport(
        device=device,
        dtype=str(dtype).removeprefix("torch."),
        eval_split={
            "data_fingerprint": data.fingerprint,
            "eval_ids_sha256": data.metrics.get("eval_ids_sha256"),
            "num_prompts": len(ev.prompts),
            "max_new_tokens": e.max_new_tokens,
        },
        temperatures=temperatures,
        seed=e.seed,
        max_speculative_tokens=e.max_speculative_tokens,
        shipped=shipped,
        kind=draft_kind(inputs["distill"]),
        proposers=proposer_sources(dirs, names, inputs["distill"].path.parents[1]),
        draft_vocab_size=len(vocab) if vocab else None,
        acceptance=rows,
        engine=[plain_run, shipped_run],
        speed=speed,
        num_speculative_tokens=k,
        why=why,
        dynamic_k=dynamic,
    )
    reports.write_all(report.as_json(), out)
    # what vLLM decodes to check the bundle (pipeline/vllm_check.py): the same token ids, the same length
    (out / EVAL_PROMPTS).write_text(json.dumps({"prompt_token_ids": ev.prompts, "max_new_tokens": e.max_new_tokens}))
    return report.metrics()


def check_gates(cfg: DraftsmithConfig, output: StageOutput) -> None:
    gate = with_gates(cfg, output)["gates"]
    for warning in gate_failures(gate, hard=False):
        log.warning(
            "evaluation gate %s not met: published all the same, with a warning in the bundle's card "
            "(evaluate.alpha_gate=hard holds such a draft back)",
            warning,
        )
    failed = gate_failures(gate, hard=True)
    if failed and not cfg.publish.override_gates:
        raise GateFailed(
            "evaluation gate failed: " + "; ".join(failed) + f". Report: {output.path / 'eval.md'}. "
            "Publishing is blocked; distil a better draft, relax evaluate.min_alpha / evaluate.max_tau_loss "
            "(or evaluate.alpha_gate=warn), "
            "or publish anyway with publish.override_gates=true"
        )


# the fingerprint: every setting the stage reads (the gates are judged after it), and the device it ran on
STAGE = Stage(
    name="evaluate",
    config_keys=("evaluate", "device", "target.dtype"),
    excluded_keys=GATE_KEYS,
    identity=lambda cfg: {"device": pick_device(cfg.device.value)},
    inputs=("target", "data", "distill", "quantize"),
    run=run,
    check=check_gates,
    artifacts=("eval.json", "eval.md", *reports.PLOTS),
)
