"""`draftsmith run` end to end on a tiny local target: stages, caching, MLflow parent and child runs."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from draftsmith.pipeline.config import TargetConfig
from draftsmith.pipeline.target import TargetError, resolve_target_dir

DRAFTSMITH = str(Path(sys.executable).parent / "draftsmith")


def draftsmith_run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run([DRAFTSMITH, "run", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def mlflow_runs(root: Path):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("t")
    return client.search_runs([experiment.experiment_id])


def test_multirun_is_one_parent_with_a_child_per_job(tiny_models, tmp_path):
    target_dir, _ = tiny_models["llama"]
    root = tmp_path / "runs"
    done = draftsmith_run("-m", "experiment=t", "target=hf", f"target.name_or_path={target_dir}",
                          f"paths.root={root}", "seed=1,2", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = mlflow_runs(root)
    parents = [r for r in runs if r.data.tags.get("draftsmith.kind") == "sweep"]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId")]
    assert len(parents) == 1 and len(children) == 2 and len(runs) == 3
    assert {c.data.tags["mlflow.parentRunId"] for c in children} == {parents[0].info.run_id}
    assert sorted(c.data.params["seed"] for c in children) == ["1", "2"]
    assert all(r.info.status == "FINISHED" for r in runs)
    assert all(c.data.metrics["target.vocab_size"] == 97 for c in children)
    # the target stage's output is shared by both jobs: one directory, the second job reused it
    assert len(list((root / "target").iterdir())) == 1
    assert {c.data.tags["stage.target.cached"] for c in children} == {"true", "false"}


def test_single_run_then_cached_then_tracking_off(tiny_models, tmp_path):
    target_dir, _ = tiny_models["qwen2"]
    root = tmp_path / "runs"
    args = ("experiment=t", "target=hf", f"target.name_or_path={target_dir}", f"paths.root={root}")
    first = draftsmith_run(*args, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "ran" in first.stdout and "not built yet" in first.stdout
    second = draftsmith_run(*args, cwd=tmp_path)
    assert "cached" in second.stdout
    reference = json.loads(next((root / "target").glob("*/target.json")).read_text())
    assert reference["path"] == str(target_dir) and reference["vocab_size"] == 97
    assert len(reference["sha256"]["config.json"]) == 64
    runs = mlflow_runs(root)
    assert len(runs) == 4  # two invocations, each a parent and a child
    off = draftsmith_run(*args, "tracking.enabled=false", cwd=tmp_path)
    assert off.returncode == 0 and len(mlflow_runs(root)) == 4


def test_bad_config_fails_before_any_work(tmp_path):
    done = draftsmith_run("quantize.bits=2", f"paths.root={tmp_path / 'runs'}", cwd=tmp_path)
    assert done.returncode == 2
    assert "quantize.bits=2 is not allowed: 4 or 8" in done.stdout
    assert not (tmp_path / "runs" / "target").exists()


def test_unresolvable_targets_say_what_to_do(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(TargetError, match="has no config.json"):
        resolve_target_dir(TargetConfig(name_or_path=str(tmp_path / "empty")))
    with pytest.raises(TargetError, match="neither an HF model dir nor a .gguf file"):
        resolve_target_dir(TargetConfig(name_or_path=str(tmp_path / "nothing-here")))
    with pytest.raises(TargetError, match="on an offline machine pass a local HF dir"):
        os.environ["HF_HUB_OFFLINE"] = "1"
        try:
            resolve_target_dir(TargetConfig(name_or_path="someone/some-model"))
        finally:
            del os.environ["HF_HUB_OFFLINE"]


def test_demo_target_converts_to_a_safetensors_llama(demo_target_dir):
    config = json.loads((demo_target_dir / "config.json").read_text())
    assert (config["model_type"], config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == ("llama", 30, 576, 49152)
    assert config["num_attention_heads"] == 9 and config["num_key_value_heads"] == 3 and config["tie_word_embeddings"]
    assert "quantization_config" not in config
    assert (demo_target_dir / "model.safetensors").is_file() and (demo_target_dir / "chat_template.jinja").is_file()
    tokenizer_config = json.loads((demo_target_dir / "tokenizer_config.json").read_text())
    assert tokenizer_config["eos_token"] == "<|im_end|>"  # the GGUF names another; the model's eos id is 2
