"""MLflow tracking: one parent run per invocation (a whole multirun sweep is one), a child per job.

The parent is opened by a Hydra callback before the first job and closed after the last; its id
reaches the jobs (also in launcher subprocesses) through DRAFTSMITH_MLFLOW_PARENT_RUN_ID.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Iterator, Mapping

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from draftsmith.pipeline.stage import process_rank

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("DO_NOT_TRACK", "true")

PARENT_ENV = "DRAFTSMITH_MLFLOW_PARENT_RUN_ID"
PARENT_URI_ENV = "DRAFTSMITH_MLFLOW_PARENT_URI"
JOB_RUN_ENV = "DRAFTSMITH_MLFLOW_JOB_RUN_ID"  # the job's child run: the registry logs the bundle into it


def run_root(paths_root: str) -> Path:
    return Path(paths_root).expanduser().resolve()


def tracking_uri(uri: str | None, paths_root: str) -> str:
    """The configured URI, or the embedded sqlite store in the run root."""
    if uri:
        return uri
    root = run_root(paths_root)
    root.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{root / 'mlflow.db'}"


def client(uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def experiment_id(mlflow_client, name: str, root: Path | None = None) -> str:
    """The experiment's id, creating it with its artifacts under the run root (not ./mlruns of the
    directory the command ran in)."""
    found = mlflow_client.get_experiment_by_name(name)
    if found:
        return found.experiment_id
    location = (root / "mlartifacts" / name).as_uri() if root is not None else None
    return mlflow_client.create_experiment(name, artifact_location=location)


def source_tags() -> dict[str, str]:
    """What MLflow's UI shows as the run's source: the command, the user and the git commit of the
    working directory (or of draftsmith's own checkout when it is installed from one)."""
    import getpass
    import subprocess
    import sys

    tags = {
        "mlflow.source.name": " ".join(["draftsmith", *sys.argv[1:]])[:500],
        "mlflow.source.type": "LOCAL",
        "mlflow.user": getpass.getuser(),
    }
    for where in (Path.cwd(), Path(__file__).resolve().parent):
        try:
            done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True)
        except OSError:  # no git on this machine (a container): no commit tag
            break
        if done.returncode == 0:
            tags["mlflow.source.git.commit"] = done.stdout.strip()
            break
    return tags


def where_tags() -> dict[str, str]:
    """Which machine and process ran a job (and its Slurm job id): a sweep's jobs may run anywhere."""
    import socket

    tags = {"draftsmith.host": socket.gethostname(), "draftsmith.pid": str(os.getpid())}
    if slurm := os.environ.get("SLURM_JOB_ID"):
        tags["draftsmith.slurm_job_id"] = slurm
    return tags


def flatten(tree: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            yield from flatten(value, f"{name}.")
        else:
            yield name, value


def _uri_from(config: DictConfig) -> str:
    return tracking_uri(config.tracking.uri, config.paths.root)


class ParentRunCallback(Callback):
    """Opens the invocation's parent run in MLflow and closes it with the right status."""

    def _open(self, config: DictConfig, kind: str) -> None:
        if not config.tracking.enabled or os.environ.get(PARENT_ENV) or process_rank()[0] != 0:
            return
        if kind == "run":  # a configuration that fails validation gets no run at all
            from draftsmith.pipeline.config import ConfigError, validate_run

            try:
                validate_run(OmegaConf.masked_copy(config, [key for key in config if key != "hydra"]))
            except ConfigError:
                return
        c = client(_uri_from(config))
        run = c.create_run(
            experiment_id(c, config.experiment, run_root(config.paths.root)),
            run_name=f"{config.experiment}-{kind}",
            tags={"draftsmith.kind": kind, **source_tags()},
        )
        os.environ[PARENT_ENV] = run.info.run_id
        os.environ[PARENT_URI_ENV] = _uri_from(config)
        self._opened = (c, run.info.run_id)

    def _close(self, status: str) -> None:
        opened = getattr(self, "_opened", None)
        if opened is None:
            return
        c, run_id = opened
        c.set_terminated(run_id, status=status)
        os.environ.pop(PARENT_ENV, None)
        os.environ.pop(PARENT_URI_ENV, None)
        self._opened = None

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._open(config, "run")

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._open(config, "sweep")

    def on_run_end(self, config: DictConfig, **kwargs: Any) -> None:
        self._close("FINISHED")

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        self._close("FINISHED")


def close_parent_if_open(status: str) -> None:
    """Called by the CLI after Hydra returns or raises: a parent left open by a failure ends FAILED."""
    run_id = os.environ.pop(PARENT_ENV, None)
    uri = os.environ.pop(PARENT_URI_ENV, None)
    if run_id and uri:
        c = client(uri)
        if c.get_run(run_id).info.status == "RUNNING":
            c.set_terminated(run_id, status=status)


class JobRun:
    """The child run of one job: params at start, stage metrics as stages finish."""

    def __init__(self, uri: str, experiment: str, run_name: str, params: Mapping[str, Any], root: Path):
        self.client = client(uri)
        tags = {"draftsmith.kind": "job", **source_tags(), **where_tags()}
        if parent := os.environ.get(PARENT_ENV):
            tags["mlflow.parentRunId"] = parent
        run = self.client.create_run(experiment_id(self.client, experiment, root), run_name=run_name, tags=tags)
        self.run_id = run.info.run_id
        os.environ[JOB_RUN_ENV] = self.run_id
        from mlflow.entities import Param

        items = [Param(k, str(v)[:6000]) for k, v in flatten(params)]
        for i in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[i : i + 100])

    def log_stage(self, name: str, fingerprint: str, cached: bool, metrics: Mapping[str, Any]) -> None:
        from mlflow.entities import Metric, RunTag

        now = int(time.time() * 1000)
        history = metrics.get("history", [])  # per-step curves, e.g. held-out TVD during training
        curves = {k for point in history for k in point}  # a curve carries its final value: not logged twice at step 0
        numeric = [
            Metric(f"{name}.{k}", float(v), now, 0)
            for k, v in flatten(metrics)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in curves
        ]
        for point in history:
            numeric += [
                Metric(f"{name}.{k}", float(v), now, int(point["step"]))
                for k, v in point.items()
                if k != "step" and isinstance(v, (int, float))
            ]
        tags = [RunTag(f"stage.{name}.fingerprint", fingerprint), RunTag(f"stage.{name}.cached", str(cached).lower())]
        self.client.log_batch(self.run_id, metrics=numeric, tags=tags)

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        self.client.log_artifact(self.run_id, str(path), artifact_path)

    def end(self, status: str) -> None:
        os.environ.pop(JOB_RUN_ENV, None)
        self.client.set_terminated(self.run_id, status=status)


def config_params(cfg: DictConfig) -> dict[str, Any]:
    """The config as plain values: `distill.loss=tvd`, not the enum's repr, so that runs filter by it."""
    return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)  # type: ignore[return-value]
