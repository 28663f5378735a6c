"""A sweep's comparison table: every job of `draftsmith run -m` leaves its outcome in its Hydra job
directory, and the command ends with one table of all of them, best first (whatever the launcher: with
submitit the jobs run in processes of their own, and the table reads what they wrote)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable, Mapping

from hydra.experimental.callback import Callback
from omegaconf import DictConfig
from rich.console import Console
from rich.markup import escape
from rich.table import Table

RESULT_JSON = "result.json"
SWEEP_DIR_ENV = "DRAFTSMITH_SWEEP_DIR"
# (stage, metric, column): what tells jobs apart, in pipeline order
COLUMNS = (
    ("distill", "tvd_final", "held-out TVD"),
    ("distill", "tokens_per_s", "train tok/s"),
    ("distill", "tokens_per_s_stage", "stage tok/s"),
    ("quantize", "tvd_rise_rel", "AWQ TVD rise"),
    ("evaluate", "alpha", "alpha (K=1)"),
    ("evaluate", "num_speculative_tokens", "K"),
    ("evaluate", "tau", "tau"),
    ("evaluate", "predicted_speedup", "predicted"),
    ("evaluate", "measured_speedup", "measured"),
)


def write_result(job_dir: Path, overrides: Iterable[str], outputs: list, error: str | None = None) -> None:
    """One job's outcome: its overrides, each finished stage's scalar metrics, and its error if it failed."""
    stages = {out.name: {k: v for k, v in out.metrics.items() if isinstance(v, (int, float, str, bool)) or v is None} for out in outputs}
    result = {
        "overrides": list(overrides),
        "status": "failed" if error else "ok",
        "error": error,
        "stages": stages,
        "outputs": {out.name: str(out.path) for out in outputs},
    }
    (job_dir / RESULT_JSON).write_text(json.dumps(result, indent=2))


def read_results(sweep_dir: Path) -> list[dict[str, Any]]:
    results = []
    for path in sorted(sweep_dir.glob(f"**/{RESULT_JSON}")):
        try:
            results.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError):
            continue  # a job killed while writing it: the table shows the others
    return results


def rank(results: list[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Best first: measured speedup, then alpha, then held-out TVD (lower is better); failed jobs last."""

    def key(r: Mapping[str, Any]):
        s = r["stages"]
        get = lambda stage, metric, default: v if isinstance(v := s.get(stage, {}).get(metric), (int, float)) else default
        return (
            r["status"] != "ok",
            -get("evaluate", "measured_speedup", float("-inf")),
            -get("evaluate", "alpha", float("-inf")),
            get("distill", "tvd_final", float("inf")),
        )

    return sorted(results, key=key)


def summary(results: list[Mapping[str, Any]], title: str) -> Table:
    """The jobs side by side, named by the overrides that differ between them."""
    common = set.intersection(*(set(r["overrides"]) for r in results)) if results else set()
    shown = [c for c in COLUMNS if any(c[1] in r["stages"].get(c[0], {}) for r in results)]
    table = Table(title=title)
    table.add_column("job", overflow="fold")  # never cut: it is the only name a job has
    for column in ("status", *(c[2] for c in shown)):
        table.add_column(column)
    for r in rank(results):
        # overrides such as quantize.ignore=[lm_head] are text, not rich markup
        name = escape(" ".join(o for o in r["overrides"] if o not in common) or "defaults")
        status = "ok" if r["status"] == "ok" else f"[red]failed[/red]: {escape((r['error'] or '')[:60])}"
        cells = []
        for stage, metric, _ in shown:
            v = r["stages"].get(stage, {}).get(metric)
            cells.append("" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v))
        table.add_row(name, status, *cells)
    return table


def print_summary(console: Console | None = None) -> None:
    """After a sweep (called by the CLI when Hydra returns or raises): the table of its jobs, if any wrote one."""
    sweep_dir = os.environ.pop(SWEEP_DIR_ENV, None)
    if not sweep_dir or not (results := read_results(Path(sweep_dir))):
        return
    (console or Console()).print(summary(results, f"draftsmith sweep: {len(results)} jobs, best first ({sweep_dir})"))


class SweepCallback(Callback):
    """Remembers the sweep's directory for the table the CLI prints at the end."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        os.environ[SWEEP_DIR_ENV] = str(Path(config.hydra.sweep.dir).absolute())
