"""The quantize stage: AWQ the distilled draft, check it again, and measure what quantization cost.

Output: draft/ (compressed-tensors W4A16 HF dir with the target's tokenizer files). Metrics: size on
disk of the draft in bf16 against W4A16 (total and without the embedding / LM head tables),
held-out TVD to the target before and after, greedy agreement of the two drafts, time taken.
With quantize.enabled=false, or for an EAGLE-3 head (one small layer: there is little to save and
its acceptance is what pays), the stage writes no draft and later stages use the distilled one as it is.
"""

from __future__ import annotations

import json
import random
import struct
import time
from pathlib import Path
from typing import Any, Mapping

from draftsmith.distill.heldout import compare_drafts
from draftsmith.distill.teacher import load_teacher
from draftsmith.distill.tokenizer import adopt_target_tokenizer
from draftsmith.pipeline.config import DraftKind, DraftsmithConfig
from draftsmith.pipeline.stage import Stage, StageOutput
from draftsmith.pipeline.target import load_reference
from draftsmith.quantize.awq import quantize_awq, quietly
from draftsmith.serve.device import pick_device

_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
_TABLES = ("embed_tokens", "lm_head")  # kept in high precision; shown apart so the quantized part is visible


def draft_dir_of(distill: StageOutput, quantize: StageOutput | None) -> Path:
    """The draft later stages ship: W4A16 when the quantize stage wrote one, else the bf16 draft."""
    if quantize is not None and (quantize.path / "draft" / "config.json").is_file():
        return quantize.path / "draft"
    return distill.path / "draft"


def tensor_sizes(model_dir: Path) -> dict[str, tuple[str, int]]:
    """name -> (dtype, number of elements) of every tensor, read from the safetensors headers only."""
    sizes = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with file.open("rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        for name, info in header.items():
            if name != "__metadata__":
                numel = 1
                for dim in info["shape"]:
                    numel *= dim
                sizes[name] = (info["dtype"], numel)
    return sizes


def size_mb(model_dir: Path, as_bf16: bool = False) -> dict[str, float]:
    """Bytes of the weights in MB, in total and without embedding / LM head tables (as bf16 if asked)."""
    total = without_tables = 0
    for name, (dtype, numel) in tensor_sizes(model_dir).items():
        nbytes = numel * (2 if as_bf16 and dtype in ("F32", "F16", "BF16") else _DTYPE_BYTES[dtype])
        total += nbytes
        if not any(table in name for table in _TABLES):
            without_tables += nbytes
    return {"total": round(total / 1e6, 3), "without_embeddings": round(without_tables / 1e6, 3)}


def calibration_samples(rows: list[dict], count: int, max_length: int, seed: int) -> list[list[int]]:
    """`count` training prompts with their target responses, truncated to `max_length` tokens."""
    rows = [r for r in rows if r["split"] == "train"]
    random.Random(seed).shuffle(rows)
    return [(r["prompt_ids"] + r["response_ids"])[:max_length] for r in rows[:count]]


def run(cfg: DraftsmithConfig, inputs: Mapping[str, StageOutput], out: Path) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    q = cfg.quantize
    if not q.enabled:
        return {"enabled": False}
    if cfg.draft.kind == DraftKind.eagle3:
        return {"enabled": False, "reason": "EAGLE-3 heads are not quantized"}
    target_dir = Path(load_reference(inputs["target"])["path"])
    dense_dir = inputs["distill"].path / "draft"
    rows = load_teacher(inputs["teacher"]).to_list()
    device = pick_device(cfg.device.value)
    started = time.perf_counter()
    calibration = calibration_samples(rows, q.num_calibration_samples, q.calibration_max_length, cfg.seed)
    with quietly():  # llm-compressor's bars, warnings and log lines: the stage's metrics say what it did
        done = quantize_awq(
            dense_dir,
            target_dir,
            out / "draft",
            calibration,
            bits=q.bits,
            group_size=q.group_size,
            ignore=q.ignore,
            calibration_dtype=q.calibration_dtype.value,
            observer=q.observer.value,
            rounding=q.rounding.value,
        )
    adopt_target_tokenizer(target_dir, out / "draft")  # copies the tokenizer files and checks them again
    seconds = time.perf_counter() - started

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    load = lambda path: AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    eval_rows = [r for r in rows if r["split"] == "eval" and r["response_ids"]]
    with quietly():  # the W4A16 draft decompresses at its first forward, with compressed-tensors' bars
        models = load(target_dir), [load(dense_dir), load(out / "draft")]
        compared = compare_drafts(*models, eval_rows, cfg.distill.batch_size, cfg.distill.max_seq_len, device, cfg.distill.loss_chunk_size)
    (tvd_before, tvd_after), bf16, quantized = compared["tvd"], size_mb(dense_dir, as_bf16=True), size_mb(out / "draft")
    return {
        **done,
        "seconds_quantize": round(seconds, 1),
        "size_mb_bf16": bf16["total"],
        "size_mb_quantized": quantized["total"],
        "size_mb_bf16_without_embeddings": bf16["without_embeddings"],
        "size_mb_quantized_without_embeddings": quantized["without_embeddings"],
        "tvd_before": tvd_before,
        "tvd_after": tvd_after,
        "tvd_rise_rel": tvd_after / tvd_before - 1,
        "greedy_agreement": compared["greedy_agreement"],
        "eval_tokens": compared["tokens"],
    }


# output format 2: quantization_config.ignore as re: patterns (format 1's bare names do not load in vLLM)
STAGE = Stage(
    name="quantize",
    config_keys=("quantize", "seed"),
    inputs=("target", "teacher", "distill"),
    run=run,
    identity=lambda cfg: {"output_format": 2},
)
