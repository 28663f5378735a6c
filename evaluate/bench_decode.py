"""`draftsmith bench decode`: engine-level decoding speed, side by side in one run.

Rows: transformers `generate`, draftsmith plain decoding eager and with CUDA graphs, and draftsmith
speculative decoding for each K; all greedy, batch 1, the same prompt, exactly `new_tokens` tokens.
"""
from __future__ import annotations

import json
import platform
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from draftsmith.serve.engine import DTYPES, Engine, eos_ids_of
from draftsmith.serve.sampling import SamplingParams
from draftsmith.serve.weights import load_model

DEFAULT_PROMPT = "My credit card was charged twice for the same purchase. How do I get the duplicate charge refunded?"


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


def chat_prompt(target_dir: Path, text: str) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def bench_transformers(target_dir: Path, prompt: list[int], new_tokens: int, device: str, dtype: str,
                       assistant_dir: Path | None = None) -> BenchRow:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=DTYPES[dtype]).to(device).eval()
    kwargs = {}
    if assistant_dir is not None:
        kwargs["assistant_model"] = AutoModelForCausalLM.from_pretrained(assistant_dir, dtype=DTYPES[dtype]).to(device).eval()
    ids = torch.tensor([prompt], device=device)
    settings = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, **kwargs)
    model.generate(ids, **{**settings, "max_new_tokens": 8, "min_new_tokens": 8})  # warm-up
    _sync(device)
    started = time.perf_counter()
    out = model.generate(ids, **settings)
    _sync(device)
    seconds = time.perf_counter() - started
    made = out.shape[1] - len(prompt)
    name = "transformers assisted" if assistant_dir else "transformers generate"
    return BenchRow(name, made, seconds, made)


def bench_engine(engine: Engine, method: str, prompt: list[int], new_tokens: int, k: int, repeats: int) -> tuple[BenchRow, list[int]]:
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    engine.generate([prompt], params, num_speculative_tokens=k)  # warm-up: captures the CUDA graphs
    best = None
    for _ in range(repeats):
        got = engine.generate([prompt], params, num_speculative_tokens=k)
        if best is None or got.seconds < best.seconds:
            best = got
    stats = best.stats if k else None
    row = BenchRow(method, best.num_tokens, best.seconds, best.target_steps,
                   tau=stats.tau if stats else None, acceptance_rate=stats.acceptance_rate if stats else None)
    return row, best.completions[0].tokens


def run_bench(target_dir: Path, draft_dir: Path, *, new_tokens: int = 256, ks: tuple[int, ...] = (2, 4, 6),
              device: str = "cuda", dtype: str = "bfloat16", repeats: int = 3, prompt_text: str = DEFAULT_PROMPT,
              with_transformers: bool = True, with_assisted: bool = False) -> list[BenchRow]:
    prompt = chat_prompt(target_dir, prompt_text)
    max_seq_len = len(prompt) + new_tokens + max(ks) + 8
    rows: list[BenchRow] = []
    if with_transformers:
        rows.append(bench_transformers(target_dir, prompt, new_tokens, device, dtype))
    if with_assisted:
        rows.append(bench_transformers(target_dir, prompt, new_tokens, device, dtype, assistant_dir=draft_dir))
    target = load_model(target_dir, DTYPES[dtype], device)
    draft = load_model(draft_dir, DTYPES[dtype], device)
    eos = eos_ids_of(target_dir)
    graphs = device.startswith("cuda")
    if graphs:  # what CUDA graphs alone save, then what compiling the blocks adds
        for method, graph in (("plain, eager", False), ("plain, CUDA graphs", True)):
            engine = Engine(target, draft, max_seq_len=max_seq_len, cuda_graphs=graph, compile_blocks=False, eos_token_ids=eos)
            rows.append(bench_engine(engine, method, prompt, new_tokens, 0, repeats=1)[0])
    engine = Engine(target, draft, max_seq_len=max_seq_len, cuda_graphs=graphs, eos_token_ids=eos)
    mode = "graphs+compile" if graphs else "eager"
    row, plain_tokens = bench_engine(engine, f"plain, {mode}", prompt, new_tokens, 0, repeats)
    rows.append(row)
    for k in ks:
        row, tokens = bench_engine(engine, f"speculative K={k}, {mode}", prompt, new_tokens, k, repeats)
        row.matches_plain = tokens == plain_tokens
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
