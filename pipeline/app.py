"""`draftsmith run`: the pipeline as a Hydra app (one job per run, one per combination with -m)."""

from __future__ import annotations

import json
import logging
import signal
import sys
import time
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig
from rich.console import Console
from rich.table import Table

from draftsmith.pipeline.config import ConfigError, register_schema, validate_run
from draftsmith.pipeline.graph import PIPELINE, STAGES, run_pipeline
from draftsmith.pipeline.stage import STAGE_JSON, StageError, StageOutput, process_rank
from draftsmith.pipeline.sweep import write_result
from draftsmith.pipeline.target import load_reference
from draftsmith.pipeline.tracking import JobRun, config_params, run_root, tracking_uri

register_schema()
# a log or a pipe gets whole table cells: rich wraps at 80 columns when it sees no terminal
console = Console(width=None if sys.stdout.isatty() else 200)
log = logging.getLogger("draftsmith")  # Hydra sends it to the console and to the job's app.log


def _job_name(cfg: DictConfig) -> str:
    hc = _hydra()
    return f"{cfg.experiment}[{(','.join(hc.overrides.task) if hc else '') or 'defaults'}]"


def _hydra():
    try:
        return HydraConfig.get()
    except ValueError:  # called outside Hydra (tests compose configs directly)
        return None


def _sweep_job_dir() -> Path | None:
    """This job's directory when it is one job of a sweep (-m), where it leaves its result for the table."""
    hc = _hydra()
    return Path(hc.runtime.output_dir) if hc and hc.mode == RunMode.MULTIRUN and process_rank()[0] == 0 else None


def _status(output: StageOutput) -> str:
    """ran, or cached with when it ran: a cached stage's seconds are those of the run that made it."""
    if not output.cached:
        return "ran"
    started = output.record.get("started")
    return f"cached (ran {time.strftime('%Y-%m-%d %H:%M', time.localtime(started))})" if started else "cached"


def _summary(outputs: list[StageOutput], root) -> Table:
    table = Table(title=f"draftsmith run: {root}")
    for column in ("stage", "status", "seconds", "output", "metrics"):
        table.add_column(column, overflow="fold")
    for out in outputs:
        metrics = "\n".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in out.metrics.items() if not isinstance(v, (list, dict))
        )
        table.add_row(out.name, _status(out), f"{out.record.get('seconds', 0):.1f}", out.path.name[:8], metrics)
    for name in PIPELINE[len(outputs) :]:
        table.add_row(name, "[dim]skipped (stop_after)[/dim]", "", "", "")
    return table


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt  # SIGTERM (a scheduler's stop) ends a job as Ctrl-C does: work kept, resumable


def run_job(cfg: DictConfig) -> list[StageOutput]:
    """Validate, open the job's MLflow child run, run the stages, print the summary."""
    try:
        typed = validate_run(cfg)
    except ConfigError as e:
        console.print(f"[red]configuration error:[/red] {e}")
        raise SystemExit(2) from None
    root = run_root(typed.paths.root)
    root.mkdir(parents=True, exist_ok=True)
    job = None
    if typed.tracking.enabled and process_rank()[0] == 0:  # one rank reports for a distributed job
        job = JobRun(tracking_uri(typed.tracking.uri, typed.paths.root), typed.experiment, _job_name(cfg), config_params(cfg), root)

    done: list[StageOutput] = []

    def on_stage(output: StageOutput) -> None:
        done.append(output)
        took = f"{output.record.get('seconds', 0.0):.1f} s"
        log.info(
            "stage %s: %s (%s)", output.name, f"{_status(output)}, took {took} then" if output.cached else f"ran in {took}", output.path
        )
        if job:
            job.log_stage(output.name, output.fingerprint, output.cached, output.metrics)
            for name in (STAGE_JSON, *STAGES[output.name].artifacts):
                if (output.path / name).is_file():
                    job.log_artifact(output.path / name, str(Path(output.name, name).parent))

    # Ctrl-C and a scheduler's SIGTERM both keep the work; SIGINT too when the parent ignored it (a job
    # started in the background by a script inherits SIG_IGN, and Python then never raises KeyboardInterrupt)
    previous = {sig: signal.signal(sig, _raise_interrupt) for sig in (signal.SIGTERM, signal.SIGINT)}
    sweep_dir = _sweep_job_dir()
    try:
        outputs = run_pipeline(typed, root, on_stage=on_stage)
    except BaseException as e:
        if job:
            job.end("KILLED" if isinstance(e, KeyboardInterrupt) else "FAILED")
        if sweep_dir:
            write_result(sweep_dir, HydraConfig.get().overrides.task, done, str(e) or type(e).__name__)
        if isinstance(e, KeyboardInterrupt):
            console.print(f"[yellow]{e or 'interrupted; run the same command to resume'}[/yellow]")
            raise SystemExit(130) from None
        if isinstance(e, StageError):
            console.print(f"[red]{e}[/red]")
            if sweep_dir:
                raise  # an Exception: Hydra marks this job failed and runs the sweep's other jobs
            raise SystemExit(1) from None
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if job:
        job.end("FINISHED")
    if sweep_dir:
        write_result(sweep_dir, HydraConfig.get().overrides.task, outputs)
    if process_rank()[0] == 0:
        console.print(_summary(outputs, root))
        _print_published({o.name: o for o in outputs})
    return outputs


def _print_published(outputs: dict[str, StageOutput]) -> None:
    """Where the bundle is, how good it is, and how to serve it."""
    from draftsmith.pipeline.publish import bundle_of, vllm_command

    if "publish" not in outputs:
        return
    bundle, m = bundle_of(outputs["publish"]), outputs["publish"].metrics
    target = load_reference(outputs["target"])["path"]
    log.info("bundle: %s", bundle)
    log.info(
        "alpha=%.4f (K=1) tau=%.4f num_speculative_tokens=%d measured speedup %.2fx quantization=%s",
        m["alpha"],
        m["tau"],
        m["num_speculative_tokens"],
        m["measured_speedup"],
        m["quantization"],
    )
    spec = json.loads((bundle / "speculative_config.json").read_text())
    log.info("%s", vllm_command(bundle, target, spec, m["max_model_len"]))
    registered = outputs.get("registry")
    if registered and registered.metrics.get("registered"):
        r = registered.metrics
        state = "champion" if r["champion"] else "registered, not promoted"
        log.info("registry: %s version %s: %s (%s)", r["name"], r["version"], state, r["reason"])


@hydra.main(version_base="1.3", config_path="pkg://draftsmith.conf", config_name="config")
def main(cfg: DictConfig) -> None:
    run_job(cfg)
