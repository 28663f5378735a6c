"""The distill stage: build the initial draft, train it against the teacher data, keep both.

Output: initial/ (the draft before training, a baseline for evaluate), draft/ (the distilled draft: an
HF dir, or for draft.kind=eagle3 an EAGLE-3 head in the speculators format), history.json (held-out
metrics per evaluation), draft_vocab.json (the token ids the draft proposes from, when
draft.vocab_size > 0 or for a head). Checkpoints live in the stage's work dir, so a killed run resumes
where it stopped.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any, Mapping

from draftsmith.distill import eagle
from draftsmith.distill.draft import build_draft
from draftsmith.distill.teacher import load_teacher
from draftsmith.distill.tokenizer import adopt_target_tokenizer
from draftsmith.distill.train import Distiller, DraftObjective
from draftsmith.pipeline.config import DraftKind, DraftsmithConfig
from draftsmith.pipeline.stage import Stage, StageOutput
from draftsmith.pipeline.target import load_reference
from draftsmith.serve.device import compute_dtype, pick_device
from draftsmith.serve.engine import eos_ids_of
from draftsmith.serve.weights import WeightsError, check_fits, read_config

log = logging.getLogger("draftsmith")


def run(cfg: DraftsmithConfig, inputs: Mapping[str, StageOutput], out: Path) -> dict[str, Any]:
    import torch
    from accelerate import PartialState
    from transformers import AutoModelForCausalLM

    started = time.time()
    reference = load_reference(inputs["target"])
    target_dir = Path(reference["path"])
    rows = load_teacher(inputs["teacher"]).to_list()
    train_rows, eval_rows = ([r for r in rows if r["split"] == split] for split in ("train", "eval"))
    state = PartialState(cpu=cfg.device.value == "cpu")  # one process, or one per rank under a launcher
    device = pick_device(cfg.device.value)
    vocab_size = read_config(target_dir)["vocab_size"]
    train_answers, eval_answers = [r["response_ids"] for r in train_rows], [r["response_ids"] for r in eval_rows]
    vocab = eagle.draft_vocabulary(train_answers, vocab_size, cfg.draft.vocab_size)
    covered = eagle.coverage(eval_answers, vocab)
    by_size = eagle.coverage_by_size(train_answers, eval_answers, vocab_size) if len(vocab) < vocab_size else {}
    if by_size:
        sizes = ", ".join(f"{size}: {share:.1%}" for size, share in by_size.items())
        log.info(
            "distill: the draft vocabulary (%d tokens) holds %.1f%% of the held-out answers' tokens (%s)", len(vocab), 100 * covered, sizes
        )
    online = cfg.distill.loss.value != "hard_label" and "topk_ids" not in train_rows[0]  # else the logit cache
    # training on a CPU runs without autocast: there the target computes in the student's float32
    dtype = compute_dtype(cfg.target.dtype.value, device) if device.startswith("cuda") else torch.float32
    try:
        check_fits(target_dir, dtype, device)
        target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype)
    except WeightsError:
        if cfg.draft.kind == DraftKind.eagle3 or online or cfg.distill.on_policy_fraction > 0:
            raise
        # a draft model trained from the teacher's logit cache needs the target for held-out TVD only
        log.warning("distill: the target does not fit %s; training from the teacher's logit cache without it (no held-out TVD)", device)
        target = None
    if cfg.draft.kind == DraftKind.eagle3:
        student, objective = eagle_student(cfg, target, reference, vocab, out / "initial", state.is_main_process)
    else:
        student, objective = draft_student(cfg, target_dir, out / "initial", state, online)
    state.wait_for_everyone()
    distiller = Distiller(
        cfg.distill, student, target, objective, train_rows, eval_rows, out, cfg.seed, cpu=device == "cpu", eos=eos_ids_of(target_dir)
    )
    result = distiller.train()
    distiller.save_draft(out / "draft")
    if state.is_main_process:
        if cfg.draft.kind != DraftKind.eagle3:
            adopt_target_tokenizer(target_dir, out / "draft")
        if len(vocab) < vocab_size:
            eagle.write_vocab(out, vocab, covered)
        shutil.rmtree(out / "checkpoint", ignore_errors=True)
        (out / "history.json").write_text(json.dumps(result["history"], indent=2))
    state.wait_for_everyone()
    first, last = result["history"][0], result["history"][-1]
    kept = next(h for h in result["history"] if h["step"] == result["kept_step"])
    if kept is not last:
        lowest = (kept["step"], last["step"], kept["eval_tvd"], last["eval_tvd"])
        log.warning(
            "distill: the held-out TVD was lowest at step %d of %d (%.4f against %.4f at the end): that step's draft ships", *lowest
        )
    return {
        "kind": cfg.draft.kind.value,
        "tvd_initial": first.get("eval_tvd"),
        "tvd_final": kept.get("eval_tvd"),  # of the draft this stage outputs: distill.keep_best's step's
        "kept_step": kept["step"],
        "eval_loss_final": kept.get("eval_loss"),
        "train_loss_final": result["final_train_loss"],
        "train_tokens": result["train_tokens"],
        "tokens_per_s": round(result["tokens_per_s"], 1),  # over the optimizer steps
        "tokens_per_s_stage": round(result["tokens_this_run"] / (time.time() - started), 1),  # loading, compiling, evaluations too
        "compile_seconds": round(result["compile_seconds"], 1),  # torch.compile's part of the stage (distill.compile)
        **{k: v for k, v in result.items() if k.startswith(("target_states", "compile_failed"))},  # states kept; compiling's failure
        "draft_vocab_size": len(vocab),
        "draft_vocab_coverage": round(covered, 4),
        "draft_vocab_coverage_by_size": by_size,  # held-out answers' tokens that other sizes would hold
        **{k: v for k, v in kept.items() if k.startswith(("eval_alpha", "eval_tau"))},
        "history": result["history"],
    }


def draft_student(cfg: DraftsmithConfig, target_dir: Path, initial: Path, state, online: bool):
    """A standalone draft: built from the target (or from scratch, or a pretrained model) on its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    if state.is_main_process and not (initial / "config.json").is_file():
        build_draft(cfg.draft, target_dir, initial, cfg.seed, Path(cfg.target.cache_dir))
        adopt_target_tokenizer(target_dir, initial)
    state.wait_for_everyone()
    draft = AutoModelForCausalLM.from_pretrained(initial, dtype=torch.float32)
    if cfg.draft.init.value == "pretrained" and cfg.draft.lora_rank > 0:
        draft = with_lora(draft, cfg.draft.lora_rank)
    return draft, DraftObjective(cfg.distill, online)


def eagle_student(cfg: DraftsmithConfig, target, reference: dict, vocab: list[int], initial: Path, main: bool):
    """An EAGLE-3 head on the target's hidden states, unrolled for training-time test."""
    aux = eagle.resolve_aux_layers(list(cfg.draft.aux_layers), reference["num_hidden_layers"])
    head, layer_config = eagle.build_head(Path(reference["path"]), cfg.draft.num_layers, aux, vocab, cfg.seed)
    verifier = {"name_or_path": reference["name_or_path"], "architectures": [reference["architecture"]]}
    objective = eagle.EagleObjective(cfg.distill, aux, vocab, layer_config, verifier)
    chunk = eagle.loss_chunk(cfg.distill.loss_chunk_size, reference["vocab_size"] or len(vocab), len(vocab))
    student = eagle.UnrolledHead(head, target.get_input_embeddings(), cfg.draft.ttt_steps, cfg.draft.ttt_decay, chunk=chunk)
    if main and not (initial / "config.json").is_file():
        objective.save(student, initial)
    return student, objective


def with_lora(model, rank: int):
    """Train low-rank adapters on every projection instead of all weights (merged when saved)."""
    from peft import LoraConfig, get_peft_model

    modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=modules))


STAGE = Stage(name="distill", config_keys=("draft", "distill", "seed"), inputs=("target", "teacher"), run=run, distributed=True)
