"""Cached, atomic stages.

A stage writes into a temporary directory beside its final place and renames it into place only
when complete, with a stage.json holding its fingerprint (hash of its config sections, of extra
identity facts such as a source file's sha256, and of its inputs' fingerprints), timings, metrics and
library versions. An output whose stage.json carries the same fingerprint is reused as it is.
"""

from __future__ import annotations

import dataclasses
import enum
import fcntl
import hashlib
import json
import os
import platform
import shutil
import time
import traceback
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Mapping

STAGE_JSON = "stage.json"
_TRACKED_LIBRARIES = (
    "draftsmith",
    "torch",
    "transformers",
    "safetensors",
    "llmcompressor",
    "compressed-tensors",
    "datasets",
    "accelerate",
    "peft",
    "mlflow",
    "hydra-core",
)


class StageError(RuntimeError):
    """A stage failed; the message names the stage and the cause. Nothing half-written is left."""


class StageInterrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM during a stage: its work dir is kept, so the same command resumes it."""


@dataclass(frozen=True)
class StageOutput:
    name: str
    path: Path
    fingerprint: str
    cached: bool
    record: dict[str, Any]

    @property
    def metrics(self) -> dict[str, Any]:
        return self.record.get("metrics", {})


# run(cfg, inputs, out_dir) writes the stage's files into out_dir and returns its metrics
StageFn = Callable[[Any, Mapping[str, StageOutput], Path], dict[str, Any]]
IdentityFn = Callable[[Any], dict[str, Any]]


@dataclass(frozen=True)
class Stage:
    name: str
    config_keys: tuple[str, ...]  # sections of the config that change this stage's output
    inputs: tuple[str, ...]  # upstream stages whose outputs this stage reads
    run: StageFn
    identity: IdentityFn | None = None  # facts outside the config that change the output
    distributed: bool | Callable[[Any], bool] = False  # under torchrun / accelerate launch every rank takes part in
    # run() (a function of the config: when it says so)
    check: Callable[[Any, "StageOutput"], None] | None = None  # run on the output, fresh or cached; raising fails the job
    artifacts: tuple[str, ...] = ()  # files of the output logged to MLflow
    excluded_keys: tuple[str, ...] = ()  # dotted keys inside config_keys' sections that do not change the output


def process_rank() -> tuple[int, int]:
    """(rank, world size) of this process when launched by torchrun or accelerate launch."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


def fingerprint(config: Mapping[str, Any], identity: Mapping[str, Any], inputs: Mapping[str, str]) -> str:
    """sha256 over canonical JSON of the stage's config sections, identity facts and input fingerprints."""
    payload = json.dumps(
        {"config": _jsonable(config), "identity": _jsonable(identity), "inputs": dict(sorted(inputs.items()))},
        sort_keys=True,
        separators=(",", ":"),
    )
    return hashlib.sha256(payload.encode()).hexdigest()


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def library_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in _TRACKED_LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return versions


def read_record(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads((path / STAGE_JSON).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def config_section(cfg: Any, key: str) -> Any:
    """cfg's section at a dotted key ("distill.teacher")."""
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def stage_config(stage: Stage, cfg: Any) -> dict[str, Any]:
    """The config sections that make the stage's fingerprint, less its excluded keys."""
    config = {key: _jsonable(config_section(cfg, key)) for key in stage.config_keys}
    for excluded in stage.excluded_keys:
        section, _, name = excluded.rpartition(".")
        if isinstance(config.get(section), dict):
            config[section].pop(name, None)
    return config


def check_stage(stage: Stage, cfg: Any, output: StageOutput) -> None:
    """The stage's check on its output (a gate, say): a failure stops the pipeline after it."""
    if stage.check:
        try:
            stage.check(cfg, output)
        except Exception as e:
            raise StageError(f"stage '{stage.name}': {e}") from e


def run_stage(stage: Stage, cfg: Any, inputs: Mapping[str, StageOutput], root: Path) -> StageOutput:
    """Run `stage` into root/<name>/<fingerprint[:16]>, or reuse that output if it is complete.

    The stage works in root/<name>/.tmp-<fingerprint[:16]>: a run killed outright leaves it there, and
    the next run with the same fingerprint gets it back, so a stage can resume from what it wrote
    (teacher shards, training checkpoints); so does one interrupted (Ctrl-C, SIGTERM). A stage that
    raises leaves nothing. A lock file keeps two jobs of a sweep from building the same output at
    once: the second waits and reuses the first's.
    """
    config = stage_config(stage, cfg)
    identity = stage.identity(cfg) if stage.identity else {}
    fp = fingerprint(config, identity, {name: inputs[name].fingerprint for name in stage.inputs})
    final = root / stage.name / fp[:16]
    final.parent.mkdir(parents=True, exist_ok=True)
    rank, world = process_rank()
    distributed = stage.distributed(cfg) if callable(stage.distributed) else stage.distributed
    if distributed and world > 1 and rank != 0:
        return _run_beside_rank_zero(stage, cfg, inputs, final, fp)
    (root / ".locks").mkdir(exist_ok=True)
    with open(root / ".locks" / f"{stage.name}-{fp[:16]}", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        record = read_record(final)
        if record is not None and record.get("fingerprint") == fp:
            output = StageOutput(stage.name, final, fp, cached=True, record=record)
        else:
            output = _build(stage, cfg, inputs, final, fp, config, identity)
    return output


def _work_dir(final: Path, fp: str) -> Path:
    """Where a stage builds its output: fixed per fingerprint, so a killed run's work is found again."""
    return final.parent / f".tmp-{fp[:16]}"


def _run_beside_rank_zero(
    stage: Stage, cfg: Any, inputs: Mapping[str, StageOutput], final: Path, fp: str, timeout: float = 24 * 3600
) -> StageOutput:
    """A non-zero rank of a distributed stage: work in rank 0's work dir, then wait for it to publish."""
    record = read_record(final)
    if record is not None and record.get("fingerprint") == fp:
        return StageOutput(stage.name, final, fp, cached=True, record=record)
    tmp = _work_dir(final, fp)
    tmp.mkdir(exist_ok=True)
    stage.run(cfg, {name: inputs[name] for name in stage.inputs}, tmp)
    deadline = time.time() + timeout
    while (record := read_record(final)) is None or record.get("fingerprint") != fp:
        if time.time() > deadline:
            raise StageError(f"stage '{stage.name}': rank 0 did not publish {final} in time")
        time.sleep(0.5)
    return StageOutput(stage.name, final, fp, cached=False, record=record)


def _build(stage: Stage, cfg: Any, inputs: Mapping[str, StageOutput], final: Path, fp: str, config: dict, identity: dict) -> StageOutput:
    tmp = _work_dir(final, fp)
    tmp.mkdir(exist_ok=True)
    started = time.time()
    try:
        metrics = stage.run(cfg, {name: inputs[name] for name in stage.inputs}, tmp) or {}
        record = {
            "stage": stage.name,
            "fingerprint": fp,
            "config": _jsonable(config),
            "identity": _jsonable(identity),
            "inputs": {name: {"fingerprint": inputs[name].fingerprint, "path": str(inputs[name].path)} for name in stage.inputs},
            "started": started,
            "seconds": round(time.time() - started, 3),
            "metrics": _jsonable(metrics),
            "versions": library_versions(),
        }
        (tmp / STAGE_JSON).write_text(json.dumps(record, indent=2, sort_keys=True))
        if final.exists():  # an incomplete leftover: replace it
            shutil.rmtree(final)
        os.rename(tmp, final)
    except KeyboardInterrupt:  # a kill's work survives; so does an interrupt's
        raise StageInterrupted(
            f"stage '{stage.name}' interrupted; its work so far is kept in {tmp}: run the same command to resume"
        ) from None
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, SystemExit):
            raise
        # the stage's frames hold what it loaded (a target on the device, say): a sweep keeps a failed job's
        # error until it ends (Hydra's launchers do), and the next job would load beside them
        traceback.clear_frames(e.__traceback__)
        raise StageError(f"stage '{stage.name}' failed: {type(e).__name__}: {e}") from e
    return StageOutput(stage.name, final, fp, cached=False, record=record)
