"""data -> teacher -> distill on a tiny chat target: held-out split, logit cache, training that lowers
the held-out TVD, a sweep sharing one teacher cache, and exact resume after SIGKILL."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

DRAFTSMITH = str(Path(sys.executable).parent / "draftsmith")


def args_for(target: Path, root: Path, *extra: str, multirun: bool = False) -> list[str]:
    return [
        DRAFTSMITH,
        "run",
        *(["-m"] if multirun else []),
        "experiment=t",
        "target=hf",
        f"target.name_or_path={target}",
        f"paths.root={root}",
        "tracking.enabled=false",
        "data.max_prompts=40",
        "data.eval_fraction=0.2",
        "distill.teacher.max_new_tokens=12",
        "distill.teacher.top_k_logits=16",
        "distill.batch_size=4",
        "draft.num_layers=1",
        "distill.warmup_steps=2",
        "distill.learning_rate=3e-3",
        "distill.freeze_embeddings=false",
        "stop_after=distill",
        *extra,
    ]


def run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    done = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=900, env={**os.environ, "COLUMNS": "200"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done


def record(root: Path, stage: str) -> dict:
    outputs = [p for p in (root / stage).iterdir() if not p.name.startswith(".")]
    assert len(outputs) == 1
    return json.loads((outputs[0] / "stage.json").read_text()) | {"path": str(outputs[0])}


def test_distillation_lowers_held_out_tvd_and_a_sweep_shares_the_teacher(tiny_chat_target, tmp_path):
    # a tiny random target spreads its mass thinly over 49,152 tokens, so its top-k cache says little:
    # this test trains from online target logits (the cache is checked in the resume test)
    root = tmp_path / "runs"
    online = ("distill.max_steps=30", "distill.eval_every=15", "distill.teacher.top_k_logits=0")
    run(args_for(tiny_chat_target, root, *online), tmp_path)
    data, teacher, distill = record(root, "data"), record(root, "teacher"), record(root, "distill")
    assert data["metrics"]["num_eval"] == 8 and data["metrics"]["num_train"] == 32
    eval_ids = json.loads((Path(data["path"]) / "eval_ids.json").read_text())
    import datasets

    rows = datasets.load_from_disk(str(Path(teacher["path"]) / "teacher")).to_list()
    assert {r["id"] for r in rows if r["split"] == "eval"} == set(eval_ids)
    assert all(r["response_ids"] for r in rows) and "topk_ids" not in rows[0]
    m = distill["metrics"]
    assert m["tvd_final"] < 0.95 * m["tvd_initial"], m
    draft = Path(distill["path"]) / "draft"
    assert (draft / "model.safetensors").is_file() and (draft / "tokenizer.json").is_file()
    assert json.loads((draft / "config.json").read_text())["vocab_size"] == 49152

    # a sweep over the loss: both jobs reuse the data and teacher outputs built above
    sweep = run(args_for(tiny_chat_target, root, *online, "distill.loss=tvd,hard_label", multirun=True), tmp_path)
    assert len([p for p in (root / "teacher").iterdir() if not p.name.startswith(".")]) == 1
    assert len([p for p in (root / "distill").iterdir() if not p.name.startswith(".")]) == 3
    assert len(re.findall(r"│ cached \(ran [0-9-]+ [0-9:]+\) +│", sweep.stdout)) == 6  # target, data, teacher in each of the two jobs

    # freeze_embeddings: the layers learn, the (tied) embedding table and LM head stay the target's
    frozen_args = [a.replace("freeze_embeddings=false", "freeze_embeddings=true") for a in args_for(tiny_chat_target, root, *online)]
    run(frozen_args, tmp_path)
    frozen = next(
        p
        for p in (root / "distill").iterdir()
        if not p.name.startswith(".") and json.loads((p / "stage.json").read_text())["config"]["distill"]["freeze_embeddings"]
    )
    from safetensors.torch import load_file

    before, after = load_file(frozen / "initial" / "model.safetensors"), load_file(frozen / "draft" / "model.safetensors")
    embed = "model.embed_tokens.weight"
    assert (before[embed] == after[embed]).all()
    assert not (before["model.layers.0.mlp.up_proj.weight"] == after["model.layers.0.mlp.up_proj.weight"]).all()
    m = json.loads((frozen / "stage.json").read_text())["metrics"]
    assert m["tvd_final"] < m["tvd_initial"], m


def test_sigkill_then_rerun_resumes_and_ends_where_an_uninterrupted_run_ends(tiny_chat_target, tmp_path):
    settings = ("distill.max_steps=40", "distill.eval_every=5")
    straight = tmp_path / "straight"
    run(args_for(tiny_chat_target, straight, *settings), tmp_path)
    expected = record(straight, "distill")["metrics"]

    killed = tmp_path / "killed"
    process = subprocess.Popen(
        args_for(tiny_chat_target, killed, *settings),
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.time() + 600
    state = None
    while time.time() < deadline and process.poll() is None:
        found = list((killed / "distill").glob(".tmp-*/checkpoint/state.json")) if (killed / "distill").exists() else []
        if found:
            step = json.loads(found[0].read_text())["progress"]["step"]
            if step >= 15:
                state = step
                break
        time.sleep(0.2)
    assert state is not None and process.poll() is None, "training ended before it could be killed"
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    assert not list((killed / "distill").glob("[!.]*"))  # nothing published by the killed run

    import datasets

    rows = datasets.load_from_disk(str(Path(record(killed, "teacher")["path"]) / "teacher")).to_list()
    assert all(len(r["topk_ids"]) == len(r["response_ids"]) and len(r["topk_ids"][0]) == 16 for r in rows)
    resumed = run(args_for(tiny_chat_target, killed, *settings), tmp_path)
    resumed_at = re.search(r"distill: resuming from the checkpoint at step (\d+) of", resumed.stdout)
    assert resumed_at and int(resumed_at.group(1)) >= state
    got = record(killed, "distill")["metrics"]
    assert got["train_loss_final"] == pytest.approx(expected["train_loss_final"], rel=1e-6)
    assert got["tvd_final"] == pytest.approx(expected["tvd_final"], rel=1e-6)
    assert [h["step"] for h in got["history"]] == [h["step"] for h in expected["history"]]


def test_two_processes_shard_the_teacher_then_train_data_parallel(tiny_chat_target, tmp_path):
    """torchrun with 2 CPU processes (gloo): every rank runs the pipeline; the teacher stage splits the
    target across both (transformers' tensor parallelism) and answers as the whole target does on one
    device; rank 0 builds the other shared stages, both train the draft together and rank 0 publishes it."""
    import datasets
    from transformers import AutoModelForCausalLM

    root = tmp_path / "runs"
    torchrun = str(Path(sys.executable).parent / "torchrun")
    args = args_for(
        tiny_chat_target,
        root,
        "distill.max_steps=6",
        "distill.eval_every=3",
        "device=cpu",
        "distill.teacher.tensor_parallel=true",
        "target.dtype=float32",
        "distill.teacher.extra_samples=1",
    )
    done = subprocess.run(
        [torchrun, "--nproc_per_node=2", "--master_port=29517", "-m", "draftsmith.pipeline.cli", *args[1:]],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert record(root, "teacher")["metrics"]["target_split_across"] == 2
    teacher = datasets.load_from_disk(str(Path(record(root, "teacher")["path"]) / "teacher")).to_list()
    whole = AutoModelForCausalLM.from_pretrained(tiny_chat_target, dtype=torch.float32).eval()
    greedy, sampled = [r for r in teacher if "#" not in r["id"]], [r for r in teacher if r["id"].endswith("#1")]
    assert sampled and {r["id"] + "#1" for r in greedy if r["split"] == "train"} == {r["id"] for r in sampled}
    answer = {r["id"]: r["response_ids"] for r in greedy}
    assert any(r["response_ids"] != answer[r["id"].removesuffix("#1")] for r in sampled)  # they were sampled
    for row in sampled[:4]:  # sampled at T = 0.8, cached at T = 1: the target's own distribution at each position
        ids = torch.tensor([row["prompt_ids"] + row["response_ids"]])
        with torch.inference_mode():
            expected = whole(ids).logits[0, len(row["prompt_ids"]) - 1 : -1].log_softmax(-1)
        got = torch.tensor(row["topk_logprobs"])
        assert torch.allclose(got, expected.gather(1, torch.tensor(row["topk_ids"])), atol=1e-4)
    for row in greedy[:6]:  # greedy, run on past EOS and cut after it: the same tokens as the unsplit target's
        prompt = torch.tensor([row["prompt_ids"]])
        with torch.inference_mode():
            logits = whole.generate(
                prompt,
                max_new_tokens=12,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                output_logits=True,
                return_dict_in_generate=True,
            )
        tokens = logits.sequences[0, prompt.shape[1] :].tolist()
        assert row["response_ids"] == tokens[: len(row["response_ids"])]
        for step, (ids, values) in enumerate(zip(row["topk_ids"], row["topk_logprobs"])):
            expected = logits.logits[step][0].log_softmax(-1).topk(16)
            assert ids[:4] == expected.indices[:4].tolist()
            assert values == pytest.approx(expected.values.tolist(), abs=1e-4)
    distill = record(root, "distill")
    assert [h["step"] for h in distill["metrics"]["history"]] == [0, 3, 6]
    # both ranks' micro-batches count: 6 steps x batch 4 sequences of prompt + response tokens
    assert distill["metrics"]["train_tokens"] > 0 and (Path(distill["path"]) / "draft" / "model.safetensors").is_file()
    assert done.stdout.count("draftsmith run:") == 1  # one summary, from rank 0


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_teacher_stage_keeps_its_shards_and_the_same_command_resumes(tiny_chat_target, tmp_path, sig):
    root = tmp_path / "runs"
    # a shard at a time, each a few hundred ms: the signal lands while later shards are still being written
    args = args_for(tiny_chat_target, root, "distill.teacher.batch_size=1", "distill.teacher.max_new_tokens=48", "stop_after=teacher")
    process = subprocess.Popen(
        args, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "COLUMNS": "200"}
    )
    deadline = time.time() + 600
    while time.time() < deadline and process.poll() is None and not list(root.glob("teacher/.tmp-*/shards/*.arrow")):
        time.sleep(0.05)
    assert process.poll() is None, "the teacher stage ended before it could be interrupted"
    process.send_signal(sig)
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 130, output[-2000:]
    assert "stage 'teacher' interrupted" in output and "run the same command to resume" in output
    assert "Traceback" not in output
    kept = list(root.glob("teacher/.tmp-*/shards/*.arrow"))
    assert kept and not list((root / "teacher").glob("[!.]*"))  # the finished shards stay, nothing is published
    run(args, tmp_path)
    assert record(root, "teacher")["metrics"]["resumed_shards"] >= len(kept)


def test_a_target_too_large_for_the_device_trains_a_draft_from_the_logit_cache(tiny_chat_target, tmp_path, monkeypatch):
    # a target split across GPUs for the teacher stage does not fit the one device that distillation runs
    # on: a draft model trained from the teacher's logit cache does without it; what needs it is refused
    from draftsmith.pipeline.config import composed
    from draftsmith.pipeline.graph import run_pipeline
    from draftsmith.pipeline.stage import StageError
    from draftsmith.serve.weights import WeightsError

    overrides = [
        a
        for a in args_for(tiny_chat_target, tmp_path / "runs", "distill.max_steps=4", "distill.eval_every=2", "device=cpu")[2:]
        if a != "stop_after=distill"
    ]
    config = lambda *extra: composed(*overrides, *extra)
    run_pipeline(config("stop_after=teacher"), tmp_path / "runs")
    monkeypatch.setattr("draftsmith.serve.weights.free_bytes", lambda device: 1024)  # a device of 1 KiB from here on
    distill = {o.name: o for o in run_pipeline(config("stop_after=distill"), tmp_path / "runs")}["distill"]
    assert distill.record["metrics"]["train_tokens"] > 0 and (distill.path / "draft" / "model.safetensors").is_file()
    assert distill.record["metrics"]["tvd_final"] is None  # held-out TVD needs the target
    with pytest.raises((StageError, WeightsError), match="does not fit"):  # on-policy data: the target scores it
        run_pipeline(config("stop_after=distill", "distill.on_policy_fraction=0.5"), tmp_path / "runs")


def test_a_split_teacher_outside_torchrun_says_how_to_launch(tiny_chat_target, monkeypatch):
    from draftsmith.distill.teacher import load_sharded

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match="torchrun --nproc_per_node N"):
        load_sharded(tiny_chat_target, torch.float32, "cpu")
