"""The evaluation report: what the evaluate stage measured, typed (EvalReport), written as eval.json (the
glossary of serve/stats.py names its fields), PNG plots and a markdown table."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draftsmith.evaluate.acceptance import Computed, Measurement
from draftsmith.evaluate.cost import INITIAL, faster_notes

PLOTS = ("acceptance_by_position.png", "tau_vs_k.png", "speedup.png")
FORMAT_VERSION = 3  # 3: rows' accepted / drafted is "acceptance_rate" (it was "alpha"); dynamic_k


@dataclass
class Speed:
    """Whole-step costs and speeds at the evaluation batch size (milliseconds, tokens/s)."""

    batch_size: int
    plain_step_ms: float
    step_ms: dict[str, dict[int, float]]  # proposer -> K -> ms (0: plain, timed in the same turns)
    predicted_speedup: dict[str, dict[int, float]]  # proposer -> K -> x plain
    measured_speedup: dict[str, dict[int, float]]  # the shipped draft -> its K -> x plain, from the engine runs
    disturbed: bool  # the measured speedup came out above tau: the machine was busy with something else
    faster_than_plain: list[int]  # the shipped draft's Ks whose step timed faster than a plain step (cost.faster_than_plain)
    runs_tokens_per_s: dict[str, list[float]]
    plain_tokens_per_s: float
    tokens_per_s: float

    def as_json(self) -> dict:
        by_k = lambda table: {name: {str(k): round(v, 4) for k, v in row.items()} for name, row in table.items()}
        return {
            "batch_size": self.batch_size,
            "plain_step_ms": round(self.plain_step_ms, 4),
            "step_ms": by_k(self.step_ms),
            "predicted_speedup": by_k(self.predicted_speedup),
            "measured_speedup": by_k(self.measured_speedup),
            "disturbed": self.disturbed,
            "faster_than_plain": self.faster_than_plain,
            "runs_tokens_per_s": {n: [round(v, 2) for v in r] for n, r in self.runs_tokens_per_s.items()},
            "plain_tokens_per_s": round(self.plain_tokens_per_s, 2),
            "tokens_per_s": round(self.tokens_per_s, 2),
        }


@dataclass
class EvalReport:
    device: str
    dtype: str
    eval_split: dict[str, Any]  # data fingerprint, held-out ids' sha256, num_prompts, max_new_tokens
    temperatures: list[float]
    seed: int
    max_speculative_tokens: int
    shipped: str  # the proposer publish ships
    kind: str  # standalone or eagle3
    proposers: dict[str, str]  # name -> where it came from
    draft_vocab_size: int | None
    acceptance: list[Computed]
    engine: list[Measurement]  # plain decoding and the shipped draft at the chosen K
    speed: Speed
    num_speculative_tokens: int
    why: str
    dynamic_k: dict[str, Any]  # the K that pays at each batch size (evaluate.stage.k_by_batch_size)

    def rows(self, proposer: str, temperature: float = 0.0) -> dict[int, Computed]:
        return {r.k: r for r in self.acceptance if r.proposer == proposer and r.temperature == temperature}

    def as_json(self) -> dict:
        """eval.json."""
        shipped, plain = self.engine[1], self.engine[0]
        computed_tau = self.rows(self.shipped)[self.num_speculative_tokens].tau
        dynamic = {
            key: (
                {str(b): ({str(k): round(v, 4) for k, v in row.items()} if isinstance(row, dict) else row) for b, row in value.items()}
                if isinstance(value, dict)
                else value
            )
            for key, value in self.dynamic_k.items()
        }
        return {
            "format_version": FORMAT_VERSION,
            "device": self.device,
            "dtype": self.dtype,
            "eval_split": self.eval_split,
            "temperatures": self.temperatures,
            "seed": self.seed,
            "max_speculative_tokens": self.max_speculative_tokens,
            "shipped": self.shipped,
            "kind": self.kind,
            "proposers": self.proposers,
            "draft_vocab_size": self.draft_vocab_size,
            "acceptance": [r.as_dict() for r in self.acceptance],
            "engine": [plain.as_dict(), shipped.as_dict()],
            "cross_check": {
                "proposer": self.shipped,
                "k": self.num_speculative_tokens,
                "temperature": 0.0,
                "computed_tau": computed_tau,
                "measured_tau": shipped.stats.tau,
                "difference": shipped.stats.tau - computed_tau,
                "outputs_equal_plain": shipped.outputs == plain.outputs,
            },
            "speed": self.speed.as_json(),
            "num_speculative_tokens": self.num_speculative_tokens,
            "why": self.why,
            "dynamic_k": dynamic,
        }

    def metrics(self) -> dict[str, Any]:
        """The stage's metrics (stage.json, MLflow): alpha, the chosen K's tau and acceptance rate, tau at K = 5
        of every proposer, the speedups."""
        rows, k = self.rows(self.shipped), self.num_speculative_tokens
        tau5 = {name: self.rows(name)[5].tau for name in self.proposers if self.max_speculative_tokens >= 5}
        measured = self.engine[1].stats.tau
        return {
            "num_speculative_tokens": k,
            "alpha": rows[1].acceptance_rate,
            "tau": rows[k].tau,
            "acceptance_rate": rows[k].acceptance_rate,
            "shipped": self.shipped,
            "kind": self.kind,
            **{f"tau_k5_{name}": v for name, v in tau5.items()},
            "tau_k5_distilled_over_initial": tau5[self.shipped] / tau5[INITIAL] if tau5 else None,
            "predicted_speedup": self.speed.predicted_speedup[self.shipped][k],
            "measured_speedup": self.speed.measured_speedup[self.shipped][k],
            "measured_tau": measured,
            "tau_difference": measured - rows[k].tau,
            "k_schedule": json.dumps(self.dynamic_k["schedule"]),
        }


def upgraded(report: dict) -> dict:
    """An eval.json of an earlier format in this one's names: rows' "alpha" (accepted / drafted at K) is
    "acceptance_rate" since format 3, so a bundle written before still verifies, serves and registers."""
    if report.get("format_version", 0) >= FORMAT_VERSION:
        return report
    rename = lambda row: {("acceptance_rate" if key == "alpha" else key): value for key, value in row.items()}
    return {
        **report,
        "acceptance": [rename(r) for r in report.get("acceptance", [])],
        "engine": [rename(r) for r in report.get("engine", [])],
    }


def read_report(path: Path) -> dict:
    """eval.json, in this format's names whatever format wrote it."""
    return upgraded(json.loads(Path(path).read_text()))


def rows_of(report: dict, proposer: str, temperature: float) -> dict[int, dict]:
    """K -> acceptance row of one proposer at one temperature."""
    return {r["k"]: r for r in report["acceptance"] if r["proposer"] == proposer and r["temperature"] == temperature}


def write_json(report: dict, out: Path) -> None:
    (out / "eval.json").write_text(json.dumps(report, indent=2, sort_keys=True))


def write_plots(report: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temperatures = report["temperatures"]
    shipped, max_k = report["shipped"], report["max_speculative_tokens"]

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in report["proposers"]:
        for t, style in zip(temperatures, ("-", "--")):
            row = rows_of(report, name, t).get(max_k)
            if row:
                positions = range(1, len(row["acceptance_by_position"]) + 1)
                ax.plot(positions, row["acceptance_by_position"], style, marker="o", label=f"{name} T={t:g}")
    ax.set(xlabel="draft position", ylabel="P(accepted)", ylim=(0, 1), title=f"Acceptance by position (K={max_k})")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / PLOTS[0], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in report["proposers"]:
        for t, style in zip(temperatures, ("-", "--")):
            rows = rows_of(report, name, t)
            ks = sorted(k for k in rows if k > 0)
            ax.plot(ks, [rows[k]["tau"] for k in ks], style, marker="o", label=f"{name} T={t:g}")
    ax.set(xlabel="K (num_speculative_tokens)", ylabel="tau (tokens per target step)", title="Mean accepted length")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / PLOTS[1], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    speed = report["speed"]
    for name, curve in speed["predicted_speedup"].items():
        ks = sorted(int(k) for k in curve)
        ax.plot(ks, [curve[str(k)] for k in ks], "-" if name == shipped else ":", marker="o", label=f"predicted ({name})")
    for k, value in speed["measured_speedup"].get(shipped, {}).items():
        ax.plot([int(k)], [value], "*", markersize=14, color="black", label=f"measured, engine ({shipped})")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.axvline(report["num_speculative_tokens"], color="green", linewidth=0.8, label="chosen K")
    ax.set(xlabel="K", ylabel="speedup over plain decoding", title=f"Speedup at T=0 on {report['device']} (batch {speed['batch_size']})")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / PLOTS[2], dpi=120)
    plt.close(fig)


def predicted_table(speed: dict, shipped: str) -> list[str]:
    """Markdown lines: each proposer's predicted speedup by K at the evaluation batch size, and the
    alternatives predicted faster than the shipped draft (cost.faster_notes)."""
    predicted = {name: {int(k): v for k, v in curve.items()} for name, curve in speed["predicted_speedup"].items()}
    ks = sorted({k for curve in predicted.values() for k in curve})
    lines = [
        f"**Predicted speedup over plain decoding at batch {speed['batch_size']}** (tau x the plain step's time / the step's, "
        "both timed here)",
        "",
        "| proposer | " + " | ".join(f"K={k}" for k in ks) + " |",
        "|---" * (len(ks) + 1) + "|",
        *(f"| {name} | " + " | ".join(f"{curve[k]:.2f}x" if k in curve else "" for k in ks) + " |" for name, curve in predicted.items()),
        "",
    ]
    for note in faster_notes(predicted, shipped):
        lines += [note, ""]
    return lines


def markdown(report: dict) -> str:
    """Tables of tau per proposer and K with alpha (K = 1) and the share kept at the chosen K, the chosen K and the gates."""
    max_k = report["max_speculative_tokens"]
    ks = range(1, max_k + 1)
    chosen_k = report["num_speculative_tokens"]
    lines = [
        f"Held-out prompts: {report['eval_split']['num_prompts']}, {report['eval_split']['max_new_tokens']} new "
        f"tokens each, on {report['device']}. tau = tokens per target step (bonus included); alpha = the share "
        f"of drafted tokens the target keeps at K=1; kept = accepted / drafted at the chosen K (vLLM's acceptance "
        f"rate, which falls with K).",
        "",
    ]
    for t in report["temperatures"]:
        lines += [
            f"**T = {t:g}**",
            "",
            "| proposer | " + " | ".join(f"tau K={k}" for k in ks) + f" | alpha | kept K={chosen_k} |",
            "|---" * (max_k + 3) + "|",
        ]
        for name in report["proposers"]:
            rows = rows_of(report, name, t)
            taus = " | ".join(f"{rows[k]['tau']:.3f}" if k in rows else "" for k in ks)
            rate = lambda k: f"{rows[k]['acceptance_rate']:.3f}" if k in rows else ""
            lines.append(f"| {name} | {taus} | {rate(1)} | {rate(chosen_k)} |")
        lines.append("")
    k, check, speed = report["num_speculative_tokens"], report["cross_check"], report["speed"]
    lines += predicted_table(speed, report["shipped"])
    runs = speed.get("runs_tokens_per_s", {}).get("plain", [])
    of_runs = f" (medians of {len(runs)} runs each, plain and speculative in turns)" if len(runs) > 1 else ""
    lines += [
        f"Chosen num_speculative_tokens: **{k}** ({report['why']}).",
        "",
        f"Computed from one teacher-forced pass per proposer (expected values at T > 0). The engine at K={k}, T=0: "
        f"tau {check['measured_tau']:.4f} against the computed {check['computed_tau']:.4f} (difference "
        f"{check['difference']:+.4f}); {speed['tokens_per_s']:.1f} tokens/s against plain decoding's "
        f"{speed['plain_tokens_per_s']:.1f}{of_runs}: **{speed['measured_speedup'][report['shipped']][str(k)]:.2f}x** "
        f"at batch {speed['batch_size']} on {report['device']}. The runs hold each prompt's prefill, the scheduler's "
        "work between steps and a batch's ragged end (rows done at different steps), which the predicted speedups leave out."
        + (
            " The measured speedup came out above tau, which bounds it (the machine was busy with something "
            "else): the speedup reported is tau."
            if speed.get("disturbed")
            else ""
        )
        + (
            f" Steps at K={','.join(map(str, fast))} timed faster than a plain step, and K was chosen from these times: "
            "either something else had the device while they were timed (evaluate again on an idle device) or the "
            "plain step took a slow path of its own."
            if (fast := speed.get("faster_than_plain"))
            else ""
        ),
        "",
    ]
    if dynamic := report.get("dynamic_k"):
        best = ", ".join(f"{b}: K={k}" for b, k in dynamic["best_k"].items())
        lines += [
            f"The K that pays by batch size (predicted from the step costs at each; 0: plain decoding): {best}. "
            f"vLLM's schedule (num_speculative_tokens_per_batch_size): {dynamic['schedule']}.",
            "",
        ]
    if "gates" not in report:  # judged later, against the thresholds of the run that publishes
        return "\n".join(lines) + "\n"
    lines += ["| gate | threshold | value | passed |", "|---|---|---|---|"]
    for name, gate in report["gates"].items():
        if isinstance(gate, dict):
            value = "n/a" if gate["value"] is None else f"{gate['value']:.4f}"
            verdict = "yes" if gate["passed"] else "NO" if gate.get("hard", True) else "no (a warning: evaluate.alpha_gate=warn)"
            lines.append(f"| {name} | {gate['threshold']} | {value} | {verdict} |")
    return "\n".join(lines) + "\n"


def write_all(report: dict, out: Path) -> None:
    write_json(report, out)
    write_plots(report, out)
    (out / "eval.md").write_text(markdown(report))
