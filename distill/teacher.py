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

from draftsmith.distill.data import load_prompts
from draftsmith.pipeline.config import DraftsmithConfig, TeacherConfig
from draftsmith.pipeline.stage import Stage, StageOutput
from draftsmith.pipeline.target import load_reference
from draftsmith.serve.engine import Engine, compute_dtype, eos_ids_of, pick_device
from draftsmith.serve.sampling import SamplingParams
from draftsmith.serve.weights import load_model

TEACHER_DIR = "teacher"


def generate_shard(engine: Engine, batch: list[dict], cfg: TeacherConfig, eos: frozenset[int], seed: int, sample: int) -> list[dict]:
    """Responses to a batch of prompts: the first at distill.teacher.temperature, extra samples (sample >= 1)
    at sample_temperature; with top_k_logits, the target's top-k log-probabilities at each response
    position, read off the generation's own forwards. Sequences run on past EOS (a finished row costs
    the same in the batch) and are cut after it, so that EOS's own distribution is kept too."""
    temperature = cfg.temperature if sample == 0 else cfg.sample_temperature
    params = SamplingParams(temperature=temperature, max_new_tokens=cfg.max_new_tokens, seed=seed, ignore_eos=True,
                            top_logprobs=cfg.top_k_logits)
    got = engine.generate([r["prompt_ids"] for r in batch], params)
    rows = []
    for record, completion in zip(batch, got.completions):
        end = next((i + 1 for i, t in enumerate(completion.tokens) if t in eos), len(completion.tokens))
        row = {"id": record["id"] + (f"#{sample}" if sample else ""), "split": record["split"],
               "prompt_ids": record["prompt_ids"], "response_ids": completion.tokens[:end]}
        if cfg.top_k_logits:
            top = completion.logprobs.top_tokens[:end]
            row["topk_ids"], row["topk_logprobs"] = [ids for ids, _ in top], [values for _, values in top]
        rows.append(row)
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
    engine = Engine(model, max_batch_size=t.batch_size, max_seq_len=longest + t.max_new_tokens + 2)
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
                write_shard(generate_shard(engine, batch, t, frozenset(eos_ids), cfg.seed + n, sample), path)
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
