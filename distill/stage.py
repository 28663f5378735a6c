"""The distill stage: build the initial draft, train it against the teacher data, keep both.

Output: initial/ (the draft before training, a baseline for evaluate), draft/ (the distilled draft),
history.json (held-out loss and TVD per evaluation). Checkpoints live in the stage's work dir, so a
killed run resumes where it stopped.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Mapping

from draftsmith.distill.draft import build_draft
from draftsmith.distill.teacher import load_teacher
from draftsmith.distill.tokenizer import adopt_target_tokenizer
from draftsmith.distill.train import Distiller
from draftsmith.pipeline.config import DraftsmithConfig
from draftsmith.pipeline.stage import Stage, StageOutput
from draftsmith.pipeline.target import load_reference
from draftsmith.serve.engine import compute_dtype, pick_device


def run(cfg: DraftsmithConfig, inputs: Mapping[str, StageOutput], out: Path) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    target_dir = Path(load_reference(inputs["target"])["path"])
    rows = load_teacher(inputs["teacher"]).to_list()
    train_rows = [r for r in rows if r["split"] == "train"]
    eval_rows = [r for r in rows if r["split"] == "eval"]
    from accelerate import PartialState

    state = PartialState(cpu=cfg.device.value == "cpu")  # one process, or one per rank under a launcher
    initial = out / "initial"
    if state.is_main_process and not (initial / "config.json").is_file():
        build_draft(cfg.draft, target_dir, initial, cfg.seed)
        adopt_target_tokenizer(target_dir, initial)
    state.wait_for_everyone()
    device = pick_device(cfg.device.value)
    draft = AutoModelForCausalLM.from_pretrained(initial, dtype=torch.float32)
    if cfg.draft.init.value == "pretrained" and cfg.draft.lora_rank > 0:
        draft = with_lora(draft, cfg.draft.lora_rank)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=compute_dtype(cfg.target.dtype.value, device))
    distiller = Distiller(cfg.distill, draft, target, train_rows, eval_rows, out, cfg.seed, cpu=device == "cpu")
    result = distiller.train()
    distiller.save_draft(out / "draft")
    if state.is_main_process:
        adopt_target_tokenizer(target_dir, out / "draft")
        shutil.rmtree(out / "checkpoint", ignore_errors=True)
        (out / "history.json").write_text(json.dumps(result["history"], indent=2))
    state.wait_for_everyone()
    first, last = result["history"][0], result["history"][-1]
    return {"tvd_initial": first.get("eval_tvd"), "tvd_final": last.get("eval_tvd"),
            "eval_loss_final": last.get("eval_loss"), "train_loss_final": result["final_train_loss"],
            "train_tokens": result["train_tokens"], "tokens_per_s": round(result["tokens_per_s"], 1),
            "history": result["history"]}


def with_lora(model, rank: int):
    """Train low-rank adapters on every projection instead of all weights (merged when saved)."""
    from peft import LoraConfig, get_peft_model

    modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=modules))


STAGE = Stage(name="distill", config_keys=("draft", "distill", "seed"), inputs=("target", "teacher"), run=run,
              distributed=True)
