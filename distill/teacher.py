"""The teacher stage: the target answers every prompt (train and eval), saved as Arrow, optionally with
its top-k log-probabilities at each response position, so that a sweep trains from this cache instead
of running the target again. With distill.teacher.extra_samples = n, each training prompt gets n more
responses sampled at sample_temperature (more varied data per prompt; the held-out split keeps one).

Batches are written as shards into the stage's work dir as they finish: a killed run resumes at the
first missing shard. With distill.teacher.tensor_parallel, under torchrun, the target is split across
the launch's processes by transformers' tensor parallelism (a target larger than one GPU) and answers
through transformers' generate; its output is a logit cache that distillation trains from without the
target.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from draftsmith.distill.data import load_prompts
from draftsmith.pipeline.config import DraftsmithConfig, TeacherConfig
from draftsmith.pipeline.stage import Stage, StageOutput, process_rank
from draftsmith.pipeline.target import load_reference
from draftsmith.serve.device import compute_dtype, pick_device
from draftsmith.serve.engine import Engine, eos_ids_of
from draftsmith.serve.sampling import SamplingParams
from draftsmith.serve.weights import load_model

TEACHER_DIR = "teacher"


def generate_shard(engine: Engine, batch: list[dict], cfg: TeacherConfig, eos: frozenset[int], seed: int, sample: int) -> list[dict]:
    """Responses to a batch of prompts: the first at distill.teacher.temperature, extra samples (sample >= 1)
    at sample_temperature; with top_k_logits, the target's top-k log-probabilities at each response
    position, read off the generation's own forwards. Sequences run on past EOS (a finished row costs
    the same in the batch) and are cut after it, so that EOS's own distribution is kept too."""
    temperature = cfg.temperature if sample == 0 else cfg.sample_temperature
    params = SamplingParams(
        temperature=temperature, max_new_tokens=cfg.max_new_tokens, seed=seed, ignore_eos=True, top_logprobs=cfg.top_k_logits
    )
    got = engine.generate([r["prompt_ids"] for r in batch], params)
    return [
        response_row(record, sample, c.tokens, eos, c.logprobs.top_tokens if cfg.top_k_logits else None)
        for record, c in zip(batch, got.completions)
    ]


def response_row(
    record: dict, sample: int, tokens: list[int], eos: frozenset[int], top: list[tuple[list[int], list[float]]] | None
) -> dict:
    """A teacher row: the response cut after its first EOS, with the top-k (ids, log-probabilities) of
    each of its positions when `top` is given."""
    end = next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))
    row = {
        "id": record["id"] + (f"#{sample}" if sample else ""),
        "split": record["split"],
        "prompt_ids": record["prompt_ids"],
        "response_ids": tokens[:end],
    }
    if top is not None:
        row["topk_ids"], row["topk_logprobs"] = [ids for ids, _ in top[:end]], [values for _, values in top[:end]]
    return row


def generate_shard_transformers(model, batch: list[dict], cfg: TeacherConfig, eos: frozenset[int], seed: int, sample: int) -> list[dict]:
    """generate_shard's rows from the target in transformers (`model`): a family draftsmith's runtime does
    not implement (target.fallback), or the target sharded across the processes of a torchrun launch
    (transformers' tensor parallelism), where every rank runs the same batch, seeded alike, on logits
    gathered whole, so every rank draws the same tokens. Prompts are left-padded; sequences run on past
    EOS and are cut after it, as generate_shard's."""
    import torch
    from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

    temperature = cfg.temperature if sample == 0 else cfg.sample_temperature
    prompts = [r["prompt_ids"] for r in batch]
    longest = max(len(p) for p in prompts)
    device = model.get_input_embeddings().weight.device
    ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts], device=device)
    top: list[tuple[torch.Tensor, torch.Tensor]] = []
    sampled = temperature > 0

    class Cache(LogitsProcessor):  # the only processor: it sees the target's raw logits, then applies the temperature
        def __call__(self, input_ids, scores):
            if cfg.top_k_logits:  # the target's own distribution (T = 1), as generate_shard records it
                values, indices = scores.float().log_softmax(-1).topk(cfg.top_k_logits, dim=-1)
                top.append((indices, values))  # kept on the device: one copy at the end, no sync per step
            return scores / temperature if sampled else scores

    # temperature 1 and no top-k / top-p: generate adds no processor of its own, which would run before ours
    config = GenerationConfig(
        max_new_tokens=cfg.max_new_tokens,
        do_sample=sampled,
        temperature=1.0 if sampled else None,
        top_k=0,
        top_p=1.0,
        eos_token_id=None,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config, logits_processor=LogitsProcessorList([Cache()]))
    tops = [None] * len(batch)
    if cfg.top_k_logits:  # [B, steps, k] each
        top_ids, top_values = torch.stack([i for i, _ in top], 1).tolist(), torch.stack([v for _, v in top], 1).tolist()
        tops = [list(zip(i, v)) for i, v in zip(top_ids, top_values)]
    return [response_row(record, sample, tokens, eos, t) for record, tokens, t in zip(batch, out[:, longest:].tolist(), tops)]


def load_sharded(target_dir: Path, dtype, device: str):
    """The target split across this torchrun launch's processes with transformers' tensor parallelism
    (NCCL on GPUs, one per process; gloo on CPUs)."""
    import os

    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    world = process_rank()[1]
    if world < 2:
        raise ValueError(
            "distill.teacher.tensor_parallel shards the target across the processes of a torchrun launch: "
            "run `torchrun --nproc_per_node N -m draftsmith.pipeline.cli run ...` with N >= 2"
        )
    if not dist.is_initialized():
        if device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
    return AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype, distributed_config=DistributedConfig(tp_size=world)).eval()


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
    reference = load_reference(inputs["target"])
    target_dir = Path(reference["path"])
    prompts = sorted(load_prompts(inputs["data"]).to_list(), key=lambda r: (len(r["prompt_ids"]), r["id"]))
    device = pick_device(cfg.device.value)
    longest = max(len(r["prompt_ids"]) for r in prompts)
    dtype = compute_dtype(cfg.target.dtype.value, device)
    eos_ids = frozenset(eos_ids_of(target_dir))
    shards = out / "shards"
    shards.mkdir(exist_ok=True)
    train = [r for r in prompts if r["split"] == "train"]
    batches = [(0, prompts[i : i + t.batch_size]) for i in range(0, len(prompts), t.batch_size)]
    batches += [(s, train[i : i + t.batch_size]) for s in range(1, t.extra_samples + 1) for i in range(0, len(train), t.batch_size)]
    done = {n for n in range(len(batches)) if (shards / f"shard-{n:05d}.arrow").exists()}  # resumed: before any rank writes
    rank, world = process_rank()
    writer = rank == 0 or not t.tensor_parallel  # unsplit, whichever rank holds the stage's lock runs it alone
    if t.tensor_parallel:  # every rank runs every batch on its slice of the target; rank 0 writes
        import torch.distributed as dist

        model = load_sharded(target_dir, dtype, device)
        dist.barrier()  # every rank has listed the finished shards
        generate = lambda n, sample, batch: generate_shard_transformers(model, batch, t, eos_ids, cfg.seed + n, sample)
    elif reference.get("runtime") == "transformers":  # target.fallback: generate() keeps a KV cache
        from draftsmith.serve.transformers_model import load_transformers_model

        model = load_transformers_model(target_dir, dtype, device).hf
        generate = lambda n, sample, batch: generate_shard_transformers(model, batch, t, eos_ids, cfg.seed + n, sample)
    else:
        engine = Engine(load_model(target_dir, dtype, device), max_batch_size=t.batch_size, max_seq_len=longest + t.max_new_tokens + 2)
        generate = lambda n, sample, batch: generate_shard(engine, batch, t, eos_ids, cfg.seed + n, sample)
    with Progress(disable=not writer) as progress:
        task = progress.add_task("teacher: target answers prompts", total=sum(len(b) for _, b in batches))
        for n, (sample, batch) in enumerate(batches):
            if n not in done:
                rows = generate(n, sample, batch)
                if writer:
                    write_shard(rows, shards / f"shard-{n:05d}.arrow")
            progress.advance(task, len(batch))
    if not writer:  # rank 0 gathers the shards and publishes
        return {}
    table = datasets.concatenate_datasets([datasets.Dataset.from_file(str(p)) for p in sorted(shards.glob("*.arrow"))])
    table.save_to_disk(str(out / TEACHER_DIR))
    for p in shards.iterdir():
        p.unlink()
    shards.rmdir()
    response_tokens = sum(len(r) for r in table["response_ids"])
    return {
        "num_examples": len(table),
        "response_tokens": response_tokens,
        "mean_response_tokens": round(response_tokens / len(table), 1),
        "resumed_shards": len(done),
        "top_k_logits": t.top_k_logits,
        "target_split_across": world if t.tensor_parallel else 1,
    }


def load_teacher(output: StageOutput):
    import datasets

    return datasets.load_from_disk(str(output.path / TEACHER_DIR))


STAGE = Stage(
    name="teacher",
    config_keys=("distill.teacher", "seed"),
    inputs=("target", "data"),
    run=run,
    distributed=lambda cfg: cfg.distill.teacher.tensor_parallel,
)
