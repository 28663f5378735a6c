"""`draftsmith run`: the pipeline as a Hydra app (one job per run, one per combination with -m)."""
from __future__ import annotations

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig
from rich.console import Console
from rich.table import Table

import hydra
from draftsmith.pipeline.config import ConfigError, register_schema, validate
from draftsmith.pipeline.graph import not_built, run_pipeline
from draftsmith.pipeline.stage import StageOutput, process_rank
from draftsmith.pipeline.tracking import JobRun, config_params, run_root, tracking_uri

register_schema()
console = Console()


def _job_name(cfg: DictConfig) -> str:
    try:
        hc = HydraConfig.get()
        overrides = ",".join(hc.overrides.task) or "defaults"
        return f"{cfg.experiment}[{overrides}]"
    except ValueError:  # called outside Hydra (tests compose configs directly)
        return f"{cfg.experiment}[defaults]"


def _summary(outputs: list[StageOutput], root) -> Table:
    table = Table(title=f"draftsmith run: {root}")
    for column in ("stage", "status", "seconds", "output", "metrics"):
        table.add_column(column)
    for out in outputs:
        metrics = "\n".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={str(v)[:16]}"
                             for k, v in out.metrics.items() if not isinstance(v, (list, dict)))
        table.add_row(out.name, "cached" if out.cached else "ran", f"{out.record.get('seconds', 0):.1f}",
                      out.path.name[:8], metrics)
    for name in not_built():
        table.add_row(name, "[dim]not built yet[/dim]", "", "", "")
    return table


def run_job(cfg: DictConfig) -> list[StageOutput]:
    """Validate, open the job's MLflow child run, run the stages, print the summary."""
    try:
        typed = validate(cfg)
    except ConfigError as e:
        console.print(f"[red]configuration error:[/red] {e}")
        raise SystemExit(2) from None
    root = run_root(typed.paths.root)
    root.mkdir(parents=True, exist_ok=True)
    job = None
    if typed.tracking.enabled and process_rank()[0] == 0:  # one rank reports for a distributed job
        job = JobRun(tracking_uri(typed.tracking.uri, typed.paths.root), typed.experiment, _job_name(cfg),
                     config_params(cfg))
    try:
        outputs = run_pipeline(typed, root, on_stage=lambda o: job and job.log_stage(o.name, o.fingerprint, o.cached, o.metrics))
    except BaseException:
        if job:
            job.end("FAILED")
        raise
    if job:
        job.end("FINISHED")
    if process_rank()[0] == 0:
        console.print(_summary(outputs, root))
    return outputs


@hydra.main(version_base="1.3", config_path="pkg://draftsmith.conf", config_name="config")
def main(cfg: DictConfig) -> None:
    run_job(cfg)
