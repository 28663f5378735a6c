"""`draftsmith bench shapes`: what decoding costs at a target's shape, without its weights.

A target of a named shape (its config, random weights made on the device) decodes for real: plain
decoding, the verification forward over 1..K+1 tokens with no draft, and whole speculative steps with a
draft model of `draft_layers` layers of the target's width and with an EAGLE-3 head, at each batch size
and K (random drafts are rarely accepted: the step's cost, not its output, is measured). From these
costs and an acceptance curve (tau by K: eval.json's shipped draft, or Leviathan's expected length for
an alpha), the speedup a draft of that acceptance would give at that shape is projected:
tau(K) x plain step / speculative step. The weights' bytes over the device's memory bandwidth bound a
plain step from below; the ratio is printed too.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from draftsmith.serve.eagle import EagleHead, HeadShape, layer_config_of
from draftsmith.serve.engine import Engine
from draftsmith.serve.model import ModelArgs, Transformer
from draftsmith.serve.sampling import SamplingParams
from draftsmith.serve.stats import expected_tokens

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
SHAPES: dict[str, dict[str, Any]] = {  # the configs of public checkpoints, as their config.json say
    "llama-3.1-8b": dict(
        model_type="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=LLAMA3_ROPE,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
    ),
    "qwen2.5-7b": dict(
        model_type="qwen2",
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
    ),
    "qwen3-8b": dict(
        model_type="qwen3",
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
    ),
    "qwen2.5-1.5b": dict(  # Qwen2.5-Coder-1.5B-Instruct, preset=qwen_coder's target
        model_type="qwen2",
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
    ),
    "smollm2-135m": dict(
        model_type="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    ),
    "tiny": dict(
        model_type="llama",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    ),
}


@dataclass
class ShapeRow:
    shape: str
    method: str  # plain, verify T tokens, draft model N layers, EAGLE-3 head
    batch: int
    k: int  # drafts per step (verify: T - 1)
    ms: float  # median milliseconds per target step (verify: per forward)
    spread: tuple[float, float]
    projected_speedup: float | None = None  # tau(K) x plain / this step, for the given acceptance curve


def random_weights(module: torch.nn.Module, std: float = 0.02) -> torch.nn.Module:
    """Fill a module built on the meta device: normal weights, unit norms (what trained weights cost is
    what is measured; their values do not matter)."""
    for name, parameter in module.named_parameters():
        with torch.no_grad():
            if parameter.dim() == 1:
                parameter.fill_(1.0 if "norm" in name else 0.0)
            else:
                parameter.normal_(0.0, std)
    return module


def build(config: dict[str, Any], dtype: torch.dtype, device: str, num_layers: int | None = None) -> Transformer:
    """A Transformer of `config`'s shape (num_layers of them if given) with random weights on `device`."""
    args = ModelArgs.from_hf_config({**config, **({"num_hidden_layers": num_layers} if num_layers else {})})
    with torch.device("meta"):
        model = Transformer(args)
    model = model.to_empty(device=device).to(dtype)
    if args.tie_word_embeddings:
        model.output.weight = model.tok_embeddings.weight
    return random_weights(model).eval()


def build_head(config: dict[str, Any], dtype: torch.dtype, device: str, draft_vocab: int) -> EagleHead:
    """An EAGLE-3 head for a target of `config`'s shape: one layer, three feature layers, `draft_vocab` tokens."""
    layers = config["num_hidden_layers"]
    args = ModelArgs.from_hf_config(layer_config_of(config, 1))
    with torch.device("meta"):
        head = EagleHead(args, HeadShape((2, layers // 2, layers - 3), config["hidden_size"], min(draft_vocab, config["vocab_size"])))
    head = random_weights(head.to_empty(device=device).to(dtype))
    head.vocab = torch.arange(head.shape.draft_vocab_size, device=device)
    return head


def timed(run, repeats: int) -> tuple[float, tuple[float, float]]:
    """Median and spread of `repeats` timings of run() (milliseconds per unit it returns), after one warm-up."""
    run()
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        started = time.perf_counter()
        units = run()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append((time.perf_counter() - started) * 1000 / units)
    return statistics.median(times), (min(times), max(times))


def decode_ms(engine: Engine, batch: int, k: int, new_tokens: int, prompt_tokens: int, repeats: int) -> tuple[float, tuple[float, float]]:
    """Milliseconds per target step of greedy decoding at `batch` rows and K (0: plain), prompts of random tokens."""
    generator = torch.Generator().manual_seed(0)
    vocab = engine.target.args.vocab_size
    prompts = [torch.randint(0, vocab, (prompt_tokens,), generator=generator).tolist() for _ in range(batch)]
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    return timed(lambda: engine.generate(prompts, params, num_speculative_tokens=k).target_steps, repeats)


# datasheet memory bandwidths (GB/s) by a part of the device's name, the first match counting
BANDWIDTHS = (("H200", 4800.0), ("H100 PCIe", 2000.0), ("H100 NVL", 3900.0), ("H100", 3350.0), ("A100-SXM4-80GB", 2039.0))


def datasheet_bandwidth(device_name: str) -> float | None:
    """The memory bandwidth of a GPU this table knows by name (GB/s), else None."""
    return next((gb_s for part, gb_s in BANDWIDTHS if part in device_name), None)


def bandwidth_floor_ms(model: Transformer, bandwidth_gb_s: float) -> float:
    """A plain step reads every weight once (of an untied embedding table, only a row a token): their bytes
    over the memory bandwidth."""
    read = {id(p): p for name, p in model.named_parameters() if name != "tok_embeddings.weight" or model.args.tie_word_embeddings}
    return sum(p.numel() * p.element_size() for p in read.values()) / (bandwidth_gb_s * 1e9) * 1000


def run_shape(
    name: str,
    batches: list[int],
    ks: list[int],
    draft_layers: int,
    draft_vocab: int,
    tau: dict[int, float],
    device: str,
    dtype: torch.dtype,
    new_tokens: int,
    prompt_tokens: int,
    repeats: int,
) -> list[ShapeRow]:
    from draftsmith.evaluate.cost import time_forward

    config = SHAPES[name]
    target = build(config, dtype, device)
    seq = prompt_tokens + new_tokens + max(ks) + 2
    rows: list[ShapeRow] = []
    plain = Engine(target, None, max_batch_size=max(batches), max_seq_len=seq)
    plain_ms = {}
    for b in batches:
        plain_ms[b], spread = decode_ms(plain, b, 0, new_tokens, prompt_tokens, repeats)
        rows.append(ShapeRow(name, "plain", b, 0, plain_ms[b], spread))
        for tokens in sorted({1, *(k + 1 for k in ks)}):  # the target's forward alone over 1..K+1 tokens
            ms = [time_forward(plain.target_forward, b, tokens, plain.device, repeats=20, start=prompt_tokens) for _ in range(repeats)]
            rows.append(ShapeRow(name, f"verify {tokens} tokens", b, tokens - 1, statistics.median(ms), (min(ms), max(ms))))
    del plain
    for method, draft in (
        (f"draft model {draft_layers} layers", lambda: build(config, dtype, device, draft_layers)),
        ("EAGLE-3 head", lambda: build_head(config, dtype, device, draft_vocab)),
    ):
        engine = Engine(target, draft(), max_batch_size=max(batches), max_seq_len=seq)
        for b in batches:
            for k in ks:
                ms, spread = decode_ms(engine, b, k, new_tokens, prompt_tokens, repeats)
                projected = tau[k] * plain_ms[b] / ms if k in tau else None
                rows.append(ShapeRow(name, method, b, k, ms, spread, projected))
        del engine
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def acceptance_curve(eval_json: str | None, alpha: float | None, ks: list[int]) -> dict[int, float]:
    """tau by K: the shipped draft's at T = 0 in an eval.json, or Leviathan's expected length for alpha."""
    if eval_json:
        from pathlib import Path

        from draftsmith.evaluate.report import read_report, rows_of

        report = read_report(Path(eval_json))
        return {k: row["tau"] for k, row in rows_of(report, report["shipped"], 0.0).items()}
    return {k: expected_tokens(alpha, k) for k in ks} if alpha is not None else {}


def as_dicts(rows: list[ShapeRow]) -> list[dict]:
    return [asdict(r) for r in rows]


def results_table(rows: list[ShapeRow], floors: dict[str, float | None], title: str):
    """The rows as a rich table: each step against its shape's plain step at its batch size, the plain batch-1 step
    against the bandwidth floor, and the projected speedups."""
    from rich.table import Table

    table = Table(title=title)
    for column in ("shape", "method", "batch", "K", "ms/step", "min-max", "x plain step", "floor / plain", "projected x plain"):
        table.add_column(column, justify="left" if column in ("shape", "method") else "right")
    plain = {(r.shape, r.batch): r.ms for r in rows if r.method == "plain"}
    for r in rows:
        floor = f"{floors[r.shape] / r.ms:.0%}" if floors[r.shape] and r.method == "plain" and r.batch == 1 else ""
        table.add_row(
            r.shape,
            r.method,
            str(r.batch),
            str(r.k),
            f"{r.ms:.3f}",
            f"{r.spread[0]:.3f}-{r.spread[1]:.3f}",
            f"{r.ms / plain[(r.shape, r.batch)]:.2f}",
            floor,
            f"{r.projected_speedup:.2f}x" if r.projected_speedup else "",
        )
    return table
