"""The MLflow model registry: register a published bundle, promote the best as `champion`, roll back.

A version is the bundle logged as an MLflow pyfunc model (from code, not pickled: `mlflow_model.py`)
whose predict generates with the engine, tagged with what promotion compares. Promotion sets the alias
only when the version's gates passed, its measured speedup over plain decoding is above
evaluate.min_speedup, and it is faster than the champion (measured speedup on the same held-out split
and device; tau for versions that predate the measurement), whatever the draft kind (a standalone
draft or an EAGLE-3 head); otherwise the version stays registered, unpromoted, with the reason.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Mapping

from draftsmith.pipeline.config import DraftsmithConfig
from draftsmith.pipeline.stage import Stage, StageOutput
from draftsmith.pipeline.tracking import JOB_RUN_ENV, client, experiment_id, run_root, tracking_uri

CHAMPION = "champion"
MODEL_CODE = Path(__file__).with_name("mlflow_model.py")


class RegistryError(RuntimeError):
    """A registry request that cannot be carried out (unknown model or version, nothing to roll back to)."""


@dataclass
class Decision:
    promote: bool
    reason: str


def decide(candidate: Mapping[str, str], champion: Mapping[str, str] | None, min_speedup: float = 1.0) -> Decision:
    """Whether a version with tags `candidate` should replace the champion with tags `champion`."""
    if candidate.get("gates_passed") != "true":
        return Decision(False, "its evaluation gates failed (published with publish.override_gates=true)")
    speedup = float(candidate["speedup"])
    where = f"at K={candidate['k']} on {candidate.get('device', '?')}"
    if speedup <= min_speedup:
        return Decision(
            False,
            f"its measured speedup {speedup:.2f}x {where} is not above evaluate.min_speedup={min_speedup:g}: "
            "speculation would not pay there",
        )
    if champion is None:
        return Decision(True, f"there is no champion yet (measured speedup {speedup:.2f}x {where})")
    if (candidate.get("eval_split"), candidate.get("device")) != (champion.get("eval_split"), champion.get("device")):
        return Decision(
            False,
            "the champion was evaluated on another held-out split or device, so their speeds do not "
            "compare; `draftsmith registry promote` promotes it by hand",
        )
    key, unit = ("speedup", "x") if "speedup" in champion else ("tau", " tau")
    new, old = float(candidate[key]), float(champion[key])
    ours = f"{candidate.get('kind', 'standalone')} {new:.4f}{unit} at K={candidate['k']}"
    theirs = f"the champion's ({champion.get('kind', 'standalone')}) {old:.4f}{unit} at K={champion['k']}"
    if new > old:
        return Decision(True, f"its {ours} beats {theirs}")
    return Decision(False, f"its {ours} does not beat {theirs}")


def champion_of(mlflow_client, name: str):
    from mlflow.exceptions import MlflowException

    try:
        return mlflow_client.get_model_version_by_alias(name, CHAMPION)
    except MlflowException:
        return None


def set_champion(mlflow_client, name: str, version: str) -> None:
    """Point `champion` at `version`, remembering the version it replaces for rollback."""
    previous = champion_of(mlflow_client, name)
    if previous is not None and str(previous.version) != str(version):
        mlflow_client.set_model_version_tag(name, str(version), "draftsmith.replaced", str(previous.version))
    mlflow_client.set_registered_model_alias(name, CHAMPION, str(version))


def signature():
    """What the registered model's predict takes and returns: prompts in, completions out, and the
    sampling settings as params."""
    from mlflow.models import ModelSignature
    from mlflow.types.schema import ColSpec, ParamSchema, ParamSpec, Schema

    params = ParamSchema([ParamSpec("max_tokens", "long", 128), ParamSpec("temperature", "double", 0.0), ParamSpec("seed", "long", None)])
    return ModelSignature(inputs=Schema([ColSpec("string")]), outputs=Schema([ColSpec("string")]), params=params)


def register(
    bundle: Path, name: str, uri: str, experiment: str, tags: dict[str, str], root: Path, min_speedup: float = 1.0
) -> tuple[str, Decision]:
    """Log the bundle as a pyfunc model, register it under `name`, promote it if it is the best."""
    import mlflow

    mlflow_client = client(uri)
    mlflow.set_tracking_uri(uri)
    run_id = os.environ.get(JOB_RUN_ENV)
    with mlflow.start_run(
        run_id=run_id,
        experiment_id=None if run_id else experiment_id(mlflow_client, experiment, root),
        run_name=None if run_id else "register",
    ):
        info = mlflow.pyfunc.log_model(
            name="bundle",
            python_model=str(MODEL_CODE),
            artifacts={"bundle": str(bundle)},
            signature=signature(),
            pip_requirements=[f"draftsmith=={metadata.version('draftsmith')}"],
        )
    if not any(m.name == name for m in mlflow_client.search_registered_models(f"name = '{name}'")):
        mlflow_client.create_registered_model(name)
    version = mlflow_client.create_model_version(name, info.model_uri, run_id=info.run_id, tags=tags).version
    champion = champion_of(mlflow_client, name)
    decision = decide(tags, champion.tags if champion is not None else None, min_speedup)
    if decision.promote:
        set_champion(mlflow_client, name, version)
    mlflow_client.set_model_version_tag(name, version, "draftsmith.promotion", decision.reason)
    return str(version), decision


def version_tags(cfg: DraftsmithConfig, inputs: Mapping[str, StageOutput]) -> dict[str, str]:
    from draftsmith.pipeline.publish import bundle_of

    report = json.loads((bundle_of(inputs["publish"]) / "eval.json").read_text())  # with the gates it was published under
    split = report["eval_split"]
    return {
        "target_fingerprint": inputs["target"].fingerprint,
        "alpha": f"{inputs['evaluate'].metrics['alpha']:.6f}",
        "tau": f"{inputs['evaluate'].metrics['tau']:.6f}",
        "k": str(report["num_speculative_tokens"]),
        "quantization": inputs["quantize"].metrics.get("scheme", "none"),
        "eval_split": f"{inputs['target'].fingerprint[:16]}:{split['eval_ids_sha256']}:{split['max_new_tokens']}",
        "gates_passed": str(report["gates"]["passed"]).lower(),
        "experiment": cfg.experiment,
        "speedup": f"{inputs['evaluate'].metrics['measured_speedup']:.6f}",
        "device": report["device"],
        "kind": report.get("kind", "standalone"),
    }


def run(cfg: DraftsmithConfig, inputs: Mapping[str, StageOutput], out: Path) -> dict[str, Any]:
    from draftsmith.pipeline.publish import bundle_of

    if not cfg.tracking.enabled:
        return {"registered": False, "reason": "tracking.enabled=false"}
    name = cfg.tracking.registry_name
    version, decision = register(
        bundle_of(inputs["publish"]),
        name,
        tracking_uri(cfg.tracking.uri, cfg.paths.root),
        cfg.experiment,
        version_tags(cfg, inputs),
        run_root(cfg.paths.root),
        cfg.evaluate.min_speedup,
    )
    (out / "registered.json").write_text(
        json.dumps({"name": name, "version": version, "champion": decision.promote, "reason": decision.reason}, indent=2)
    )
    return {"registered": True, "name": name, "version": version, "champion": decision.promote, "reason": decision.reason}


# the registry's state lives in MLflow: the stage's fingerprint keeps a rerun from registering twice
STAGE = Stage(
    name="registry", config_keys=("tracking", "evaluate.min_speedup"), inputs=("target", "quantize", "evaluate", "publish"), run=run
)


def list_versions(uri: str, name: str) -> list[dict[str, str]]:
    mlflow_client = client(uri)
    champion = champion_of(mlflow_client, name)
    rows = []
    for v in sorted(mlflow_client.search_model_versions(f"name = '{name}'"), key=lambda v: int(v.version)):
        rows.append(
            {
                "version": str(v.version),
                "champion": "yes" if champion and str(champion.version) == str(v.version) else "",
                **{k: v.tags.get(k, "") for k in ("kind", "speedup", "tau", "alpha", "k", "quantization", "gates_passed")},
                "reason": v.tags.get("draftsmith.promotion", ""),
            }
        )
    return rows


def promote(uri: str, name: str, version: str) -> None:
    mlflow_client = client(uri)
    if not any(str(v.version) == str(version) for v in mlflow_client.search_model_versions(f"name = '{name}'")):
        raise RegistryError(f"{name} has no version {version} (`draftsmith registry list` shows them)")
    set_champion(mlflow_client, name, str(version))


def rollback(uri: str, name: str) -> str:
    """Point champion back at the version the current champion replaced; return that version."""
    mlflow_client = client(uri)
    champion = champion_of(mlflow_client, name)
    if champion is None:
        raise RegistryError(f"{name} has no champion to roll back")
    previous = champion.tags.get("draftsmith.replaced")
    if not previous:
        raise RegistryError(f"{name}'s champion (version {champion.version}) replaced no earlier champion")
    mlflow_client.set_registered_model_alias(name, CHAMPION, previous)
    mlflow_client.set_model_version_tag(name, str(champion.version), "draftsmith.rolled_back", "true")
    return previous
