"""`draftsmith run` end to end on a tiny local target: stages, caching, MLflow parent and child runs."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from draftsmith.pipeline.config import TargetConfig
from draftsmith.pipeline.target import TargetError, resolve_target_dir

DRAFTSMITH = str(Path(sys.executable).parent / "draftsmith")


# the smallest pipeline: 8 prompts, 4-token answers, 2 training steps
SMALL = (
    "stop_after=distill",
    "data.max_prompts=8",
    "distill.teacher.max_new_tokens=4",
    "distill.max_steps=2",
    "distill.eval_every=2",
    "draft.num_layers=1",
    "distill.batch_size=2",
)


def draftsmith_run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run([DRAFTSMITH, "run", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def mlflow_runs(root: Path):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("t")
    return client.search_runs([experiment.experiment_id])


@pytest.mark.parametrize("launcher", ["basic", "local"])
def test_multirun_is_one_parent_with_a_child_per_job(tiny_chat_target, tmp_path, launcher):
    """Hydra's basic launcher runs the jobs one after another in its own process; hydra/launcher=local
    (submitit_local) starts both at once in processes of their own, which meet at the teacher's lock.
    Either way one job builds what the other reuses, and one MLflow parent groups them."""
    root = tmp_path / "runs"
    chosen = [] if launcher == "basic" else [f"hydra/launcher={launcher}"]
    done = draftsmith_run(
        "-m",
        *chosen,
        "experiment=t",
        "target=hf",
        f"target.name_or_path={tiny_chat_target}",
        f"paths.root={root}",
        "distill.learning_rate=1e-3,2e-3",
        *SMALL,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    runs = mlflow_runs(root)
    parents = [r for r in runs if r.data.tags.get("draftsmith.kind") == "sweep"]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId")]
    assert len(parents) == 1 and len(children) == 2 and len(runs) == 3
    assert {c.data.tags["mlflow.parentRunId"] for c in children} == {parents[0].info.run_id}
    assert sorted(c.data.params["distill.learning_rate"] for c in children) == ["0.001", "0.002"]
    assert all(r.info.status == "FINISHED" for r in runs)
    assert all(c.data.metrics["target.vocab_size"] == 49152 for c in children)
    assert all("distill.tvd_final" in c.data.metrics for c in children)
    pids = {c.data.tags["draftsmith.pid"] for c in children}
    assert len(pids) == (1 if launcher == "basic" else 2)
    assert len(list((root / "hydra" / "multirun").glob("*/.submitit/*/*_log.out"))) == (0 if launcher == "basic" else 2)
    # target, data and teacher outputs are shared by both jobs: one directory each, reused by the second
    for stage in ("target", "data", "teacher"):
        assert len(list((root / stage).iterdir())) == 1
        assert {c.data.tags[f"stage.{stage}.cached"] for c in children} == {"true", "false"}
    assert len(list((root / "distill").iterdir())) == 2
    # each job left its outcome in its job directory, and the command ended with the jobs' table
    results = [json.loads(p.read_text()) for p in sorted((root / "hydra" / "multirun").glob("*/*/result.json"))]
    assert [r["status"] for r in results] == ["ok", "ok"]
    assert all(r["stages"]["distill"]["tvd_final"] > 0 for r in results)
    table = done.stdout[done.stdout.index("draftsmith sweep: 2 jobs") :]
    assert "distill.learning_rate=0.001" in table and "distill.learning_rate=0.002" in table and "held-out TVD" in table


def test_single_run_then_cached_then_tracking_off(tiny_chat_target, tmp_path):
    target_dir = tiny_chat_target
    root = tmp_path / "runs"
    args = ("experiment=t", "target=hf", f"target.name_or_path={target_dir}", f"paths.root={root}", *SMALL)
    first = draftsmith_run(*args, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "ran" in first.stdout and "skipped (stop_after)" in first.stdout
    log = first.stdout + first.stderr  # a log, not a terminal: our lines only, and table cells whole
    assert not any(noise in log for noise in ("it/s]", "Loading weights", "Saving the dataset", "No accelerator")), log[-2000:]
    assert "…" not in first.stdout
    second = draftsmith_run(*args, cwd=tmp_path)
    assert len(re.findall(r"│ cached \(ran [0-9-]+ [0-9:]+\) +│", second.stdout)) == 4  # target, data, teacher, distill
    reference = json.loads(next((root / "target").glob("*/target.json")).read_text())
    assert reference["path"] == str(target_dir) and reference["vocab_size"] == 49152
    assert len(reference["sha256"]["config.json"]) == 64
    runs = mlflow_runs(root)
    assert len(runs) == 4  # two invocations, each a parent and a child
    off = draftsmith_run(*args, "tracking.enabled=false", cwd=tmp_path)
    assert off.returncode == 0 and len(mlflow_runs(root)) == 4


@pytest.mark.parametrize(
    "override,said",
    [
        ("quantize.bits=2", "quantize.bits=2: fewer than 4 bits is refused"),
        ("data.path=prompts/missing.jsonl", "data.path='prompts/missing.jsonl': no such file or directory"),
    ],
)
def test_bad_config_fails_before_any_work(tmp_path, override, said):
    done = draftsmith_run(override, f"paths.root={tmp_path / 'runs'}", cwd=tmp_path)
    assert done.returncode == 2
    assert said in done.stdout
    assert not (tmp_path / "runs" / "target").exists()
    db = tmp_path / "runs" / "mlflow.db"  # and no empty FAILED run in the store
    if db.exists():
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=f"sqlite:///{db}")
        assert not client.search_runs([e.experiment_id for e in client.search_experiments()])


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


def test_a_conversion_reads_the_gguf_file_once():
    import gguf

    from draftsmith.pipeline.target import _gguf_read_once, demo_gguf_path

    with _gguf_read_once():
        first = gguf.GGUFReader(demo_gguf_path())
        assert gguf.GGUFReader(str(demo_gguf_path())) is first  # the config's, the weights' and the tokenizer's reads
        assert first.fields["tokenizer.ggml.tokens"].data  # a reader as made outside
    assert isinstance(gguf.GGUFReader(demo_gguf_path()), gguf.GGUFReader)  # the class again after the block


def test_a_failed_job_does_not_stop_the_sweep(tiny_chat_target, tmp_path):
    """The first job's target does not exist; the second job still runs, and the table shows both."""
    root = tmp_path / "runs"
    done = draftsmith_run(
        "-m",
        "experiment=t",
        "target=hf",
        f"target.name_or_path={tmp_path / 'missing'},{tiny_chat_target}",
        f"paths.root={root}",
        "stop_after=target",
        "tracking.enabled=false",
        cwd=tmp_path,
    )
    assert done.returncode == 1  # the sweep as a whole failed
    results = [json.loads(p.read_text()) for p in sorted((root / "hydra" / "multirun").glob("*/*/result.json"))]
    assert [r["status"] for r in results] == ["failed", "ok"] and "missing" in results[0]["error"]
    assert results[1]["stages"]["target"]["vocab_size"] == 49152
    table = done.stdout[done.stdout.index("draftsmith sweep: 2 jobs") :]
    assert table.index(str(tiny_chat_target)[-20:]) < table.index("│ failed")  # the job that ran comes first


def test_the_sweep_table_ranks_jobs_by_measured_speed_and_failed_jobs_last(tmp_path):
    from types import SimpleNamespace

    from rich.console import Console

    from draftsmith.pipeline.sweep import read_results, summary, write_result

    def job(num, overrides, error=None, **evaluate):
        (tmp_path / str(num)).mkdir()
        outputs = [
            SimpleNamespace(name="distill", metrics={"tvd_final": 0.5, "history": [1, 2]}, path=tmp_path),
            SimpleNamespace(name="evaluate", metrics=evaluate, path=tmp_path),
        ][: 1 + bool(evaluate)]
        write_result(tmp_path / str(num), ["preset=gpu", *overrides], outputs, error)

    job(0, ["draft.num_layers=2"], alpha=0.55, measured_speedup=1.10)
    job(1, ["draft.num_layers=4"], error="evaluation gate failed: alpha")
    job(2, ["draft.num_layers=6", "quantize.ignore=[lm_head]"], alpha=0.60, measured_speedup=1.25)
    console = Console(width=200, record=True)
    console.print(summary(read_results(tmp_path), "sweep"))
    rows = [line for line in console.export_text().splitlines() if "draft.num_layers" in line]
    assert [row.split()[1] for row in rows] == ["draft.num_layers=6", "draft.num_layers=2", "draft.num_layers=4"]
    assert "quantize.ignore=[lm_head]" in rows[0]  # an override is shown as written, not read as markup
    assert "failed" in rows[2] and "preset=gpu" not in "".join(rows)  # the overrides every job shares are not repeated


@pytest.mark.parametrize(
    "fallback,model_type,says",
    [
        ("refuse", "gpt_neox", "set target.fallback=transformers"),  # transformers could run it: refused as configured
        ("transformers", "no_such_family", "transformers has no causal LM for model_type 'no_such_family'"),
    ],
)
def test_an_unsupported_family_is_refused_at_the_target_stage_before_its_weights_are_read(
    tiny_chat_target, tmp_path, fallback, model_type, says
):
    # (the transformers fallback running a family end to end: tests/test_publish.py, Granite)
    import shutil

    target = tmp_path / model_type
    shutil.copytree(tiny_chat_target, target)
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "model_type": model_type, "architectures": ["GPTNeoXForCausalLM"]}))
    (target / "model.safetensors").unlink()
    (target / "model.safetensors").symlink_to(tmp_path / "nowhere")  # hashing it would fail with another error
    done = draftsmith_run(
        "experiment=t",
        "target=hf",
        f"target.name_or_path={target}",
        f"target.fallback={fallback}",
        f"paths.root={tmp_path / 'runs'}",
        "tracking.enabled=false",
        *SMALL,
        cwd=tmp_path,
    )
    assert done.returncode == 1 and "stage 'target' failed" in done.stdout
    assert f"model_type '{model_type}' is not supported" in done.stdout and "qwen3" in done.stdout and "gemma2" in done.stdout
    assert says in " ".join(done.stdout.split())
    assert not (tmp_path / "runs" / "data").exists()  # nothing ran after it
