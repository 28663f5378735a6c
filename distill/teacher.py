"""The teacher stage: the target answers every prompt (train and eval), saved as Arrow, optionally with
its top-k log-probabilities at each response position, so that a sweep trains from this cache instead
of running the target again. With distill.teacher.extra_samples = n, each training prompt gets n more
responses sampled at sample_temperature (more varied data per prompt; the held-out split keeps one).

Batches are written as shards into the stage's work dir as they finish: a killed run resumes at the
first missing shard.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import torch

from draftsmith.distill.data import load_prompts
from draftsmith.pipeline.config import DraftsmithConfig, TeacherConfig
from draftsmith.pipeline.stage import Stage, StageOutput
from draftsmith.pipeline.target import load_reference
from draftsmith.serve.engine import Engine, compute_dtype, eos_ids_of, pick_device
from draftsmith.serve.sampling import SamplingParams
from draftsmith.serve.weights import load_model

TEACHER_DIR = "teacher"


def top_k_logprobs(model, sequences: list[list[int]], starts: list[int], k: int) -> list[tuple[list, list]]:
    """For each sequence, the target's top-k (ids, logprobs) at positions start-1 .. len-2: the
    distributions each response token was drawn from."""
    device = model.output.weight.device
    longest = max(len(s) for s in sequences)
    span = max(len(s) - start for s, start in zip(sequences, starts))  # response positions only
    tokens = torch.zeros(len(sequences), longest, dtype=torch.long, device=device)
    for i, s in enumerate(sequences):
        tokens[i, : len(s)] = torch.tensor(s, device=device)
    at = (torch.tensor(starts, device=device).unsqueeze(1) - 1 + torch.arange(span, device=device)).clamp(max=longest - 1)
    with torch.inference_mode():
        logits = model(tokens, torch.arange(longest, device=device).expand(len(sequences), longest), logits_at=at)
        values, ids = logits.float().log_softmax(-1).topk(k, dim=-1)  # [B, span, k]
    return [(ids[i, : len(s) - start].int().tolist(), values[i, : len(s) - start].tolist())
            for i, (s, start) in enumerate(zip(sequences, starts))]


def generate_shard(engine: Engine, batch: list[dict], cfg: TeacherConfig, eos: int | None, seed: int, sample: int) -> list[dict]:
    """Responses to a batch of prompts: the first at distill.teacher.temperature, extra samples (sample >= 1)
    at sample_temperature."""
    temperature = cfg.temperature if sample == 0 else cfg.sample_temperature
    params = SamplingParams(temperature=temperature, max_new_tokens=cfg.max_new_tokens, seed=seed)
    got = engine.generate([r["prompt_ids"] for r in batch], params)
    rows = []
    for record, completion in zip(batch, got.completions):
        response = completion.tokens + ([eos] if completion.finish_reason == "stop" and eos is not None else [])
        rows.append({"id": record["id"] + (f"#{sample}" if sample else ""), "split": record["split"],
                     "prompt_ids": record["prompt_ids"], "response_ids": response})
    if cfg.top_k_logits:
        cached = top_k_logprobs(engine.target, [r["prompt_ids"] + r["response_ids"] for r in rows],
                                [len(r["prompt_ids"]) for r in rows], cfg.top_k_logits)
        for row, (ids, values) in zip(rows, cached):
            row["topk_ids"], row["topk_logprobs"] = ids, values
    return rows


def write_shard(rows: list[dict], path: Path) -> None:
    import pyarrow as pa

    table = pa.Table.from_pylist(rows)
    tmp = path.with_suffix(".partial")
    with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    tmp.rename(path)  # a shard is either whole or absent


def run(cfg: DraftsmithConfig, inputs: Mapping[str, StageOutput], out: Path) -> dict[str, Any]:
    import datasets
    from rich.progress import Progress

    t = cfg.distill.teacher
    target_dir = Path(load_reference(inputs["target"])["path"])
    prompts = sorted(load_prompts(inputs["data"]).to_list(), key=lambda r: (len(r["prompt_ids"]), r["id"]))
    device = pick_device(cfg.device.value)
    longest = max(len(r["prompt_ids"]) for r in prompts)
    model = load_model(target_dir, compute_dtype(cfg.target.dtype.value, device), device)
    eos_ids = sorted(eos_ids_of(target_dir))
    engine = Engine(model, max_batch_size=t.batch_size, max_seq_len=longest + t.max_new_tokens + 2,
                    eos_token_ids=frozenset(eos_ids))
    shards = out / "shards"
    shards.mkdir(exist_ok=True)
    train = [r for r in prompts if r["split"] == "train"]
    batches = [(0, prompts[i:i + t.batch_size]) for i in range(0, len(prompts), t.batch_size)]
    batches += [(s, train[i:i + t.batch_size]) for s in range(1, t.extra_samples + 1) for i in range(0, len(train), t.batch_size)]
    resumed = 0
    with Progress() as progress:
        task = progress.add_task("teacher: target answers prompts", total=sum(len(b) for _, b in batches))
        for n, (sample, batch) in enumerate(batches):
            path = shards / f"shard-{n:05d}.arrow"
            if path.exists():
                resumed += 1
            else:
                write_shard(generate_shard(engine, batch, t, eos_ids[0] if eos_ids else None, cfg.seed + n, sample), path)
            progress.advance(task, len(batch))
    table = datasets.concatenate_datasets([datasets.Dataset.from_file(str(p)) for p in sorted(shards.glob("*.arrow"))])
    table.save_to_disk(str(out / TEACHER_DIR))
    for p in shards.iterdir():
        p.unlink()
    shards.rmdir()
    response_tokens = sum(len(r) for r in table["response_ids"])
    return {"num_examples": len(table), "response_tokens": response_tokens,
            "mean_response_tokens": round(response_tokens / len(table), 1), "resumed_shards": resumed,
            "top_k_logits": t.top_k_logits}


def load_teacher(output: StageOutput):
    import datasets

    return datasets.load_from_disk(str(output.path / TEACHER_DIR))


STAGE = Stage(name="teacher", config_keys=("distill.teacher", "seed"), inputs=("target", "data"), run=run)
