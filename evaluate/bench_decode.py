"""`draftsmith bench decode`: engine-level decoding speed, side by side in one run.

Rows at batch 1, each over the same held-out demo prompts one after another, greedy, exactly
`new_tokens` tokens each: transformers `generate`, transformers assisted generation with the same draft,
draftsmith plain decoding eager and with CUDA graphs, and draftsmith speculative decoding for each K.
Then, at batch `batch` (continuous batching, `batch` requests running at once): plain, speculative
with adaptive K, and speculative at each fixed K.
"""
from __future__ import annotations

import json
import platform
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Sequence

import torch

from draftsmith.serve.engine import DTYPES, Engine, eos_ids_of
from draftsmith.serve.sampling import SamplingParams
from draftsmith.serve.scheduler import Request, Scheduler
from draftsmith.serve.stats import SpecStats
from draftsmith.serve.weights import load_model


@dataclass
class BenchRow:
    method: str
    tokens: int
    seconds: float
    target_steps: int
    tau: float | None = None
    acceptance_rate: float | None = None
    matches_plain: bool | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def ms_per_target_step(self) -> float:
        return 1000 * self.seconds / self.target_steps

    def as_dict(self) -> dict:
        return {**asdict(self), "tokens_per_s": self.tokens_per_s, "ms_per_target_step": self.ms_per_target_step}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def chat_prompts(target_dir: Path, chats: Sequence[list[dict]]) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    ids = [tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True) for chat in chats]
    return [list(i["input_ids"] if hasattr(i, "keys") else i) for i in ids]


def bench_transformers(target_dir: Path, prompts: list[list[int]], new_tokens: int, device: str, dtype: str,
                       assistant_dir: Path | None = None) -> BenchRow:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=DTYPES[dtype]).to(device).eval()
    kwargs = {}
    if assistant_dir is not None:
        kwargs["assistant_model"] = AutoModelForCausalLM.from_pretrained(assistant_dir, dtype=DTYPES[dtype]).to(device).eval()
    settings = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, **kwargs)
    model.generate(torch.tensor([prompts[0]], device=device), **{**settings, "max_new_tokens": 8, "min_new_tokens": 8})  # warm-up
    made, seconds = 0, 0.0
    for prompt in prompts:
        _sync(device)
        started = time.perf_counter()
        out = model.generate(torch.tensor([prompt], device=device), **settings)
        _sync(device)
        seconds += time.perf_counter() - started
        made += out.shape[1] - len(prompt)
    name = "transformers assisted" if assistant_dir else "transformers generate"
    return BenchRow(name, made, seconds, made)


def bench_engine(engine: Engine, method: str, prompts: list[list[int]], new_tokens: int, k: int,
                 repeats: int) -> tuple[BenchRow, list[list[int]]]:
    """Batch 1, prompt after prompt; each prompt's fastest of `repeats` runs counts."""
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    engine.generate([prompts[0]], params, num_speculative_tokens=k)  # warm-up: captures the CUDA graphs
    tokens, seconds, steps, stats, outputs = 0, 0.0, 0, SpecStats(), []
    for prompt in prompts:
        best = min((engine.generate([prompt], params, num_speculative_tokens=k) for _ in range(repeats)), key=lambda g: g.seconds)
        tokens, seconds, steps = tokens + best.num_tokens, seconds + best.seconds, steps + best.target_steps
        stats.merge(best.stats)
        outputs.append(best.completions[0].tokens)
    row = BenchRow(method, tokens, seconds, steps, tau=stats.tau if k else None,
                   acceptance_rate=stats.acceptance_rate if k else None)
    return row, outputs


def bench_batch(engine: Engine, method: str, prompts: list[list[int]], new_tokens: int, k: int, adaptive: bool,
                requests: int) -> tuple[BenchRow, list[list[int]]]:
    """`requests` requests (the prompts, cycled) through the continuous-batching scheduler."""
    stats, steps = SpecStats(), []
    record = lambda k, accepted: (stats.record(k, accepted), steps.append(k))
    scheduler = Scheduler(engine, k, adaptive=adaptive, on_step=record)
    scheduler.warm_up()  # step costs for adaptive K; on a GPU, every shape's CUDA graph
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    done: dict[int, list[int]] = {}
    _sync(str(engine.device))
    started = time.perf_counter()
    for i in range(requests):
        scheduler.submit(Request(prompts[i % len(prompts)], params, on_done=lambda r, i=i: done.__setitem__(i, r.tokens)))
    scheduler.drain()
    _sync(str(engine.device))
    seconds = time.perf_counter() - started
    outputs = [done[i] for i in range(requests)]
    row = BenchRow(method, sum(len(o) for o in outputs), seconds, len(steps), tau=stats.tau if stats.num_drafts else None,
                   acceptance_rate=stats.acceptance_rate if stats.num_drafts else None)
    return row, outputs


def run_bench(target_dir: Path, draft_dir: Path, prompts: list[list[int]], *, new_tokens: int = 256,
              ks: tuple[int, ...] = (2, 4, 6), device: str = "cuda", dtype: str = "bfloat16", repeats: int = 3,
              with_transformers: bool = True, with_assisted: bool = False, batch: int = 16) -> list[BenchRow]:
    max_seq_len = max(len(p) for p in prompts) + new_tokens + max(ks) + 8
    rows: list[BenchRow] = []
    if with_transformers:
        rows.append(bench_transformers(target_dir, prompts, new_tokens, device, dtype))
    if with_assisted:
        rows.append(bench_transformers(target_dir, prompts, new_tokens, device, dtype, assistant_dir=draft_dir))
    target = load_model(target_dir, DTYPES[dtype], device)
    draft = load_model(draft_dir, DTYPES[dtype], device)
    eos = eos_ids_of(target_dir)
    graphs = device.startswith("cuda")
    if graphs:  # what CUDA graphs alone save, then what compiling the blocks adds
        for method, graph in (("plain, eager", False), ("plain, CUDA graphs", True)):
            engine = Engine(target, draft, max_seq_len=max_seq_len, cuda_graphs=graph, compile_blocks=False, eos_token_ids=eos)
            rows.append(bench_engine(engine, method, prompts, new_tokens, 0, repeats=1)[0])
    engine = Engine(target, draft, max_seq_len=max_seq_len, cuda_graphs=graphs, eos_token_ids=eos)
    mode = "graphs+compile" if graphs else "eager"
    row, plain_tokens = bench_engine(engine, f"plain, {mode}", prompts, new_tokens, 0, repeats)
    rows.append(row)
    for k in ks:
        row, tokens = bench_engine(engine, f"speculative K={k}, {mode}", prompts, new_tokens, k, repeats)
        row.matches_plain = tokens == plain_tokens
        rows.append(row)
    if batch > 1:
        del engine  # engines share the models; each one's setup replaces their caches
        # CUDA graphs without compiling: the batch runs a few buckets x (K + 1) shapes, each a compile
        engine = Engine(target, draft, max_batch_size=batch, max_seq_len=max_seq_len, cuda_graphs=graphs,
                        compile_blocks=False, eos_token_ids=eos)
        requests = 4 * batch
        row, plain_batch = bench_batch(engine, f"plain, batch {batch}", prompts, new_tokens, 0, False, requests)
        rows.append(row)
        for k, adaptive in [(max(ks), True), *((k, False) for k in ks)]:
            name = f"speculative adaptive K<={k}, batch {batch}" if adaptive else f"speculative K={k}, batch {batch}"
            row, tokens = bench_batch(engine, name, prompts, new_tokens, k, adaptive, requests)
            row.matches_plain = tokens == plain_batch
            rows.append(row)
    return rows


def environment(device: str) -> dict:
    info = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "torch": torch.__version__,
            "python": platform.python_version(), "device": device}
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    else:
        info["cpu"] = platform.processor() or platform.machine()
    return info


def write_results(rows: list[BenchRow], path: Path, command: str, device: str, extra: dict | None = None) -> None:
    payload = {**environment(device), "command": command, **(extra or {}), "rows": [r.as_dict() for r in rows]}
    path.write_text(json.dumps(payload, indent=2))
