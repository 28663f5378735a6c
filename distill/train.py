"""Knowledge distillation of the draft from the target, through accelerate.

AdamW with linear warm-up and cosine decay, gradient accumulation and clipping; every `eval_every`
steps the held-out loss and TVD to the target, and a checkpoint (weights, optimizer, scheduler, RNG,
data position) from which a killed run resumes exactly. Data order is a seeded permutation per epoch,
so a resumed run sees the same batches an uninterrupted one would. Several processes
(`accelerate launch`) split each global batch between them (DDP).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Collection, Iterator, Sequence

import numpy as np
import torch
from torch.profiler import record_function

from draftsmith.distill import checkpoint, losses
from draftsmith.distill.on_policy import DraftSampler
from draftsmith.pipeline.config import DistillConfig
from draftsmith.serve.sampling import to_device

log = logging.getLogger("draftsmith")
BEST = "best"  # in the work dir: the student at its best held-out evaluation so far (distill.keep_best)


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor | None  # [B, L]; None for packed rows, whose position_ids say where sequences start
    predict: torch.Tensor  # [B, L] bool: positions whose next token is a response token
    labels: torch.Tensor  # [N] the response tokens, in order of `predict`
    topk_ids: torch.Tensor | None  # [N, k]
    topk_logprobs: torch.Tensor | None  # [N, k]
    position_ids: torch.Tensor | None = None  # [B, L] packed rows: each sequence counts from 0
    predict_index: torch.Tensor | None = None  # [N] flat positions of `predict`, in order: gathering by them needs no sync
    sources: tuple[dict, ...] = ()  # the rows, in the order of `labels`
    counts: tuple[int, ...] = ()  # response positions per row of `sources`

    @property
    def num_targets(self) -> int:
        return int(self.labels.numel())

    def inputs(self) -> dict[str, torch.Tensor | None]:
        """The model's keyword arguments for these rows (no cache: a packed row needs none to be seen as packed)."""
        return {"input_ids": self.input_ids, "attention_mask": self.attention_mask, "position_ids": self.position_ids, "use_cache": False}


def pack_bins(lengths: list[int], capacity: int) -> list[list[int]]:
    """First-fit decreasing: indices of `lengths` grouped so that no group's total exceeds `capacity`
    (every length is at most capacity), longest first."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        slot = next((b for b, free in enumerate(room) if free >= lengths[i]), None)
        if slot is None:
            bins.append([])
            room.append(capacity)
            slot = len(bins) - 1
        bins[slot].append(i)
        room[slot] -= lengths[i]
    return bins


def collate(rows: list[dict], max_seq_len: int, device: torch.device, pack: bool = False) -> Batch:
    """Prompt + response per row, right-padded to the longest; each response token is predicted from the
    position before it. pack=True: sequences share rows of at most max_seq_len tokens (first-fit
    decreasing), each attending to itself only, so that little compute goes to padding."""
    sequences, spans = [], []
    for row in rows:
        prompt, response = row["prompt_ids"], row["response_ids"]
        seq = (prompt + response)[:max_seq_len]
        sequences.append(seq)
        spans.append((len(prompt) - 1, len(seq) - 1))  # predicting positions [start, end)
    placement = pack_bins([len(s) for s in sequences], max_seq_len) if pack else [[i] for i in range(len(rows))]
    width = max(sum(len(sequences[i]) for i in members) for members in placement)
    input_ids = np.zeros((len(placement), width), dtype=np.int64)  # built in numpy: one copy to torch, not one per row
    attention_mask = np.zeros((len(placement), width), dtype=np.int64)
    position_ids = np.zeros((len(placement), width), dtype=np.int64)
    predict = np.zeros((len(placement), width), dtype=bool)
    labels, topk_ids, topk_logprobs, sources, counts = [], [], [], [], []
    cached = all("topk_ids" in row for row in rows)  # else (on-policy rows among them) the target runs online
    for b, members in enumerate(placement):
        offset = 0
        for i in members:  # labels in the order of `predict`, row-major
            seq, (start, end) = sequences[i], spans[i]
            input_ids[b, offset : offset + len(seq)] = seq
            attention_mask[b, offset : offset + len(seq)] = 1
            position_ids[b, offset : offset + len(seq)] = np.arange(len(seq))
            predict[b, offset + start : offset + end] = True
            labels.extend(seq[start + 1 : end + 1])
            sources.append(rows[i])
            counts.append(end - start)
            if cached:
                topk_ids.extend(rows[i]["topk_ids"][: end - start])
                topk_logprobs.extend(rows[i]["topk_logprobs"][: end - start])
            offset += len(seq)
        position_ids[b, offset:] = np.arange(width - offset)  # a packed row's padding: a sequence of its own
    has_cache = bool(topk_ids)
    to = lambda array: to_device(torch.from_numpy(array), device)
    return Batch(
        to(input_ids),
        None if pack else to(attention_mask),
        to(predict),
        to(np.array(labels, dtype=np.int64)),
        to_device(topk_ids, device) if has_cache else None,
        to_device(topk_logprobs, device) if has_cache else None,
        to(position_ids) if pack else None,
        to(np.flatnonzero(predict)),
        tuple(sources),
        tuple(counts),
    )


@torch.no_grad()
def response_logits(
    models: Sequence, rows: list[dict], batch_size: int, max_seq_len: int, device: torch.device | str, chunk: int = 0
) -> Iterator[tuple[Batch, list[torch.Tensor]]]:
    """For each batch of rows: the batch and each model's float32 logits [N, V] at its response positions, `chunk`
    positions at a time (0: all N at once; a batch of 128 rows over Qwen2.5's 151,936 tokens is 11 GB a copy)."""
    for i in range(0, len(rows), batch_size):
        batch = collate(rows[i : i + batch_size], max_seq_len, torch.device(device))
        hidden = [predicted_hidden(m, batch) for m in models]
        step = chunk or batch.num_targets
        for first in range(0, batch.num_targets, step):
            yield batch, [lm_head(m)(h[first : first + step]).float() for m, h in zip(models, hidden)]


def predicted_hidden(model, batch: Batch) -> torch.Tensor:
    """The model's final hidden states [N, H] (after its last norm, what its LM head reads) at the
    batch's response positions. Called through the model itself, so that a data-parallel wrapper sees
    its forward; its LM head runs on one position only."""
    out = model(**batch.inputs(), output_hidden_states=True, logits_to_keep=1)
    return out.hidden_states[-1].flatten(0, 1).index_select(0, batch.predict_index)


def lm_head(model) -> torch.nn.Module:
    """The model's LM head, through a data-parallel wrapper."""
    return getattr(model, "module", model).get_output_embeddings()


def predicted_logits(model, batch: Batch) -> torch.Tensor:
    """The model's logits [N, V] at the batch's response positions only: its LM head (V = 49,152 columns
    for SmolLM2) runs on those instead of on every prompt and padding position."""
    return lm_head(model)(predicted_hidden(model, batch))


class KeptStates:
    """What the target computes for fixed rows (the teacher data, the held-out split), one tensor a row, kept on
    the device from the first forward over each row: the target does not train, so a row's states never change,
    and later batches of it skip the target's forward. A draft model keeps the target's final hidden states at
    the response positions [n, H]; an EAGLE-3 head its features and final states at every position. Rows are
    known by identity and must be registered (`keep`); any other row (an on-policy continuation) runs the
    target. At most `budget_bytes` are kept, and on a GPU at most a quarter of the memory free at the first
    forward (room for training's own peak); rows beyond that run the target every time, in a batch of their own
    beside the kept rows (not the whole batch: with part of a domain's states kept, nearly every batch mixes both)."""

    def __init__(self, budget_bytes: float, max_seq_len: int):
        self.budget, self.used, self.max_seq_len = budget_bytes, 0, max_seq_len
        self.capped = False  # the budget has been set against the device's free memory
        self.registered: dict[int, dict] = {}  # id -> row, which also keeps the row (and so its id) alive
        self.states: dict[int, torch.Tensor] = {}
        self.left_out: set[int] = set()  # registered rows that the budget could not keep: they run the target each time

    def keep(self, rows: Sequence[dict]) -> None:
        if self.budget > 0:
            self.registered.update((id(row), row) for row in rows)

    @torch.no_grad()
    def rows(self, batch: Batch, compute: Callable[[Batch], Sequence[torch.Tensor]]) -> list[torch.Tensor]:
        """The batch's states, a tensor for each row of `batch.sources`: the kept ones, and compute() (the
        target's forward) over a batch of the others, keeping what the budget allows."""
        missing = [row for row in batch.sources if id(row) not in self.states]
        if not missing:
            return [self.states[id(row)] for row in batch.sources]
        todo = batch if len(missing) == len(batch.sources) else collate(missing, self.max_seq_len, batch.input_ids.device)
        computed = dict(zip((id(row) for row in todo.sources), compute(todo)))
        if not self.capped and todo.input_ids.is_cuda:
            self.budget, self.capped = min(self.budget, torch.cuda.mem_get_info(todo.input_ids.device)[0] / 4), True
        for key, part in computed.items():
            size = part.numel() * part.element_size()
            if key not in self.registered or key in self.states:
                continue
            if self.used + size <= self.budget:
                # a copy, not a view: a view would keep the whole (padded) batch's tensor alive, past the budget
                self.states[key] = part.clone()
                self.used += size
            else:
                if not self.left_out:
                    log.warning(
                        "distill: the target's states fill their budget of %.1f GiB (distill.target_states_gib, on a GPU at"
                        " most a quarter of the memory free at the first forward) after %d rows: the rows beyond run the"
                        " target at every step",
                        self.budget / 2**30,
                        len(self.states),
                    )
                self.left_out.add(key)
        return [computed[id(row)] if id(row) in computed else self.states[id(row)] for row in batch.sources]

    def summary(self) -> dict[str, float]:
        """The rows whose states are kept, their GiB, and the registered rows seen so far that did not fit."""
        return {
            "target_states_rows": len(self.states),
            "target_states_gib": round(self.used / 2**30, 3),
            "target_states_rows_left_out": len(self.left_out),
        }

    def hidden(self, target, batch: Batch) -> torch.Tensor:
        """The target's final hidden states at the batch's response positions [N, H], in `labels` order."""
        return torch.cat(self.rows(batch, lambda b: predicted_hidden(target, b).split(list(b.counts))))


class DraftObjective:
    """A standalone draft model against the target's distribution: online target logits, or the
    teacher's top-k logit cache when the rows carry one."""

    packs = True  # its rows may share sequences (distill.pack_sequences)

    def __init__(self, cfg: DistillConfig, online: bool):
        self.cfg, self.online = cfg, online
        self.against_target = losses.against_logits(cfg.loss.value, cfg.temperature, cfg.jsd_beta, compiled=cfg.compile)
        self.kept = KeptStates(cfg.target_states_gib * 2**30, cfg.max_seq_len)

    def keep_target_states(self, rows: Sequence[dict]) -> None:
        """Keep the target's states of these rows from their first forward on (distill.target_states_gib)."""
        self.kept.keep(rows)

    def loss(self, student, target, batch: Batch) -> torch.Tensor:
        needs_target = self.online or (batch.topk_ids is None and self.cfg.loss.value != "hard_label")
        head = lm_head(student)
        if self.cfg.loss_chunk_size == 0 or head.bias is not None:
            return self._whole_loss(student, target, batch, needs_target)
        with record_function("draft forward"):  # names in benchmarks/profile_train.py --profile
            hidden = predicted_hidden(student, batch)
        target_hidden = target_head = None
        if needs_target:
            with torch.no_grad(), record_function("target forward"):
                target_hidden, target_head = self.kept.hidden(target, batch), target.get_output_embeddings().weight

        def per_position(logits: torch.Tensor, rows: slice) -> torch.Tensor:
            target_logits = None
            if target_hidden is not None:
                with torch.no_grad():
                    target_logits = torch.nn.functional.linear(target_hidden[rows], target_head)
            return self.position_loss(logits, batch, target_logits, rows)

        with record_function("chunked loss"):
            return losses.chunked_mean(hidden, head.weight, per_position, self.cfg.loss_chunk_size)

    def position_loss(
        self, student_logits: torch.Tensor, batch: Batch, target_logits: torch.Tensor | None, rows: slice = slice(None)
    ) -> torch.Tensor:
        """Per-position loss [n] of the configured kind at the batch's response positions `rows`, from the
        cache or from online target logits (those rows' only)."""
        cfg = self.cfg
        if cfg.loss.value == "hard_label":
            return losses.hard_label(student_logits, batch.labels[rows])
        if target_logits is not None:
            return self.against_target(student_logits, target_logits)
        logp, logq = losses.bucketed(student_logits, batch.topk_ids[rows], batch.topk_logprobs[rows], cfg.temperature)
        return losses.divergence(cfg.loss.value, logp, logq, cfg.jsd_beta)

    def _whole_loss(self, student, target, batch: Batch, needs_target: bool) -> torch.Tensor:
        """The loss over [N, V] logits built whole (distill.loss_chunk_size=0, or an LM head with a bias)."""
        logits = predicted_logits(student, batch)  # [N, V]
        target_logits = None
        if needs_target:
            with torch.no_grad():
                target_logits = predicted_logits(target, batch)
        return self.position_loss(logits, batch, target_logits).mean()

    @torch.no_grad()
    def held_out(self, student, target, rows: list[dict], device) -> dict[str, float]:
        """Held-out loss and exact TVD to the target (full vocabulary, T = 1), per response token. The
        target's states at `rows` are kept from the first evaluation (within distill.target_states_gib):
        later ones run only its LM head (on a CPU the target's forward was most of an evaluation's time).
        The logits are made distill.loss_chunk_size positions at a time: whole, a batch of 128 rows over
        Qwen2.5's 151,936 tokens is 11 GB a float32 copy, and an evaluation held four (OOM on an H100)."""
        self.kept.keep(rows)
        student_head, target_head = lm_head(student), target.get_output_embeddings()
        total_tvd, total_loss, count = 0.0, 0.0, 0
        for start in range(0, len(rows), self.cfg.batch_size):
            batch = collate(rows[start : start + self.cfg.batch_size], self.cfg.max_seq_len, torch.device(device))
            target_hidden, hidden = self.kept.hidden(target, batch), predicted_hidden(student, batch)
            chunk, cached = self.cfg.loss_chunk_size or batch.num_targets, batch.topk_ids is not None
            for first in range(0, batch.num_targets, chunk):
                at = slice(first, first + chunk)
                target_logits, logits = target_head(target_hidden[at]).float(), student_head(hidden[at]).float()
                total_tvd += losses.tvd(*losses.full(logits, target_logits, 1.0)).sum().item()
                total_loss += self.position_loss(logits, batch, None if cached else target_logits, at).sum().item()
            count += batch.num_targets
        return {"eval_tvd": total_tvd / count, "eval_loss": total_loss / count}

    def save(self, student, out_dir: Path) -> None:
        if hasattr(student, "merge_and_unload"):  # LoRA adapters merged into a copy's weights (training goes on)
            student = copy.deepcopy(student).merge_and_unload()
        student.save_pretrained(out_dir, safe_serialization=True)


def compile_layers(model: torch.nn.Module) -> None:
    """distill.compile: torch.compile a transformers model's decoder layers in place, one by one (regional
    compilation). Its layers run the same code, so they share one compiled graph per mode (training, no
    grad) and compiling takes seconds where the whole model took minutes; dynamic shapes, since packed rows
    change shape every step. A model with its own `compile_training` (an EAGLE-3 head unrolled for training)
    compiles what it chooses. In place either way: the optimizer and checkpoints see the module's own
    parameters and names. A model with LoRA adapters (peft's wrapper, no PreTrainedModel) compiles its layers too."""
    import torch._dynamo

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)  # modes x models x dtypes
    # the modules' float attributes (norm eps, attention scale, rotary share) as constants: under dynamic shapes
    # dynamo otherwise traces them as symbolic floats, fails to turn them into tensors and traces the whole
    # graph again (the head's later steps: 62 s of tracing where one pass takes 29, on this project's CPU)
    torch._dynamo.config.specialize_float = True
    if hasattr(model, "compile_training"):
        model.compile_training()
        return
    for layer in model.get_decoder().layers:
        layer.compile(dynamic=True)


def compile_seconds() -> float:
    """Seconds torch.compile has spent in this process so far, forward and backward graphs (dynamo's own account)."""
    from torch._dynamo.utils import calculate_time_spent

    return float(calculate_time_spent().get("total_wall_time", 0.0))


def read_later(value: torch.Tensor) -> Callable[[], float]:
    """A device scalar's value, to be read later without waiting for work queued after this call: the copy to the
    host starts now, behind only what is queued so far. (`.item()` later queues its copy behind every step queued
    since, so the host would wait for the device to drain, and the device then idle while the host prepares the
    next step.)"""
    if value.device.type != "cuda":
        return value.item
    host = torch.empty((), dtype=value.dtype, pin_memory=True)
    host.copy_(value, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()

    def read() -> float:
        copied.synchronize()
        return host.item()

    return read


def lr_lambda(warmup: int, total: int) -> Callable[[int], float]:
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def seeded_order(n: int, seed: int, salt: int) -> list[int]:
    """A permutation of range(n), the same for the same seed and salt (an epoch, a group of steps)."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + salt)).tolist()


class Distiller:
    """The training loop; `objective` says what the student is and what it learns (DraftObjective here,
    distill.eagle.EagleObjective for EAGLE-3 heads): its loss on a batch, held-out metrics, saving."""

    def __init__(
        self,
        cfg: DistillConfig,
        student: torch.nn.Module,
        target,
        objective,
        train_rows: list[dict],
        eval_rows: list[dict],
        work_dir: Path,
        seed: int,
        cpu: bool = False,
        log: Callable[[int, dict[str, float]], None] = lambda step, m: None,
        eos: Collection[int] = (),
    ):
        from accelerate import Accelerator

        fits = lambda row: len(row["prompt_ids"]) < cfg.max_seq_len and row["response_ids"]  # something to learn
        train_rows, eval_rows = [r for r in train_rows if fits(r)], [r for r in eval_rows if fits(r)]
        if not train_rows:
            raise ValueError(f"no training example has a response within distill.max_seq_len={cfg.max_seq_len} tokens")
        self.cfg, self.train_rows, self.eval_rows, self.work_dir, self.seed, self.log = cfg, train_rows, eval_rows, work_dir, seed, log
        self.objective, self.eos = objective, frozenset(eos)
        self.compile_failed_at: int | None = None  # the step from which training runs uncompiled (0: the first evaluation)
        objective.keep_target_states(train_rows)
        self.sampler = DraftSampler()
        self.pack = cfg.pack_sequences and objective.packs
        cpu = cpu or not torch.cuda.is_available()
        self.accelerator = Accelerator(mixed_precision="no" if cpu else "bf16", cpu=cpu)
        self.device = self.accelerator.device
        torch.manual_seed(seed)
        random.seed(seed)
        self.target = target.to(self.device).eval().requires_grad_(False) if target is not None else None
        if cfg.freeze_embeddings and hasattr(student, "get_input_embeddings"):  # tied in SmolLM2: one table, both ends
            student.get_input_embeddings().requires_grad_(False)
            student.get_output_embeddings().requires_grad_(False)
        self.trainable = [p for p in student.parameters() if p.requires_grad]
        if cfg.compile:
            compile_layers(student)
            if self.target is not None:
                compile_layers(self.target)
        optimizer = torch.optim.AdamW(self.trainable, lr=cfg.learning_rate, weight_decay=0.0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg.warmup_steps, cfg.max_steps))
        self.draft, self.optimizer = self.accelerator.prepare(student, optimizer)
        self.scheduler = scheduler
        if (objective.online or cfg.on_policy_fraction > 0) and self.target is None:
            raise ValueError("online and on-policy distillation need the target model")

    def _on_policy(self, rows: list[dict], step: int, micro: int) -> list[dict]:
        """The first on_policy_fraction of a micro-batch's rows (already in a seeded random order) with
        their responses replaced by the draft's own continuations, as long as the teacher's."""
        n = round(len(rows) * self.cfg.on_policy_fraction)
        if n == 0:
            return rows
        draft = self.accelerator.unwrap_model(self.draft)
        draft.eval()
        seed = hash((self.seed, step, micro, self.accelerator.process_index)) % 2**63
        sampled = self.sampler(draft, [r["prompt_ids"] for r in rows[:n]], [len(r["response_ids"]) for r in rows[:n]], self.eos, seed)
        draft.train()
        return [{"prompt_ids": r["prompt_ids"], "response_ids": s} for r, s in zip(rows[:n], sampled)] + rows[n:]

    def _rows(self, start: int, count: int) -> list[dict]:
        """`count` rows from position `start` of the epochs' seeded orders, one after another."""
        epoch, offset = divmod(start, len(self.train_rows))
        order = seeded_order(len(self.train_rows), self.seed, epoch)
        while len(order) - offset < count:  # crossing an epoch boundary
            epoch += 1
            order = order + seeded_order(len(self.train_rows), self.seed, epoch)
        return [self.train_rows[i] for i in order[offset : offset + count]]

    def _micro_batches(self, step: int) -> list[list[dict]]:
        """The rows of this process's micro-batches at optimizer step `step`. With distill.length_group_steps = G,
        the rows the G steps of step's group would take are sorted by length and cut into G slices, which those
        steps take in a seeded order: each row is still seen once, in a batch of rows of about its length."""
        per_step = self.cfg.batch_size * self.cfg.grad_accum_steps
        group = self.cfg.length_group_steps
        if group > 1:
            first = step - step % group
            pool = sorted(self._rows(first * per_step, group * per_step), key=lambda r: len(r["prompt_ids"]) + len(r["response_ids"]))
            pick = seeded_order(group, self.seed, first)[step % group]
            rows = pool[pick * per_step : (pick + 1) * per_step]
        else:
            rows = self._rows(step * per_step, per_step)
        mine = rows[self.accelerator.process_index :: self.accelerator.num_processes]
        size = max(1, len(mine) // self.cfg.grad_accum_steps)
        return [mine[i : i + size] for i in range(0, len(mine), size)][: self.cfg.grad_accum_steps]

    def _compiled_or_not(self, run: Callable[[], Any], step: int) -> Any:
        """run() (step `step`'s micro-batches, or its held-out evaluation). Where torch.compile fails in it (inductor
        failed on an H200 at step 20 of a head's run), it runs again without compiling, and so does everything after
        it: slower, with a warning, not a lost run."""
        try:
            with torch.compiler.set_stance("force_eager") if self.compile_failed_at is not None else contextlib.nullcontext():
                return run()
        except torch._dynamo.exc.TorchDynamoException as error:  # not under force_eager: nothing compiles there
            cause = getattr(error, "inner_exception", None) or error  # what the backend raised
            log.warning(
                "distill: torch.compile failed at step %d (%s: %s); it and the rest train without compiling, slower "
                "(TORCHDYNAMO_VERBOSE=1 prints where; distill.compile=false skips compiling)",
                *(step, type(cause).__name__, (str(cause).strip().splitlines() or [""])[0]),
            )
            self.compile_failed_at = step
            self.optimizer.zero_grad(set_to_none=True)
            student = self.accelerator.unwrap_model(self.draft)
            if hasattr(student, "compile_training"):  # a model that compiles parts of its own (an EAGLE-3 head's unroll)
                student.compile_training(False)
            with torch.compiler.set_stance("force_eager"):
                return run()

    def _micro_steps(self, step: int) -> tuple[torch.Tensor, int]:
        """Step `step`'s micro-batches, forward and backward: (their loss, summed on the device; the tokens they train)."""
        micro, step_loss, tokens = self._micro_batches(step), torch.zeros((), device=self.device), 0
        for i, rows in enumerate(micro):
            batch = collate(self._on_policy(rows, step, i), self.cfg.max_seq_len, self.device, pack=self.pack)
            with self.accelerator.autocast():
                loss = self.objective.loss(self.draft, self.target, batch) / len(micro)
            with record_function("backward"):  # names in benchmarks/profile_train.py --profile
                self.accelerator.backward(loss)
            step_loss += loss.detach()
            tokens += batch.num_targets * self.accelerator.num_processes
        return step_loss, tokens

    def evaluate(self, step: int) -> dict[str, float]:
        """The objective's held-out metrics at `step` (nothing without the target or held-out rows)."""
        if self.target is None or not self.eval_rows:
            return {}
        self.draft.eval()
        held_out = lambda: self.objective.held_out(self.accelerator.unwrap_model(self.draft), self.target, self.eval_rows, self.device)
        metrics = self._compiled_or_not(held_out, step)
        self.draft.train()
        return metrics

    def train(self) -> dict[str, Any]:
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        cfg = self.cfg
        progress_state = checkpoint.load(self.work_dir, self.accelerator.unwrap_model(self.draft), self.optimizer, self.scheduler)
        step = progress_state["step"] if progress_state else 0
        history: list[dict] = progress_state["history"] if progress_state else []
        tokens = progress_state["tokens"] if progress_state else 0
        if progress_state and self.accelerator.is_main_process:
            print(f"distill: resuming from the checkpoint at step {step} of {cfg.max_steps} in {self.work_dir}", flush=True)
        if not history:
            history.append({"step": 0, **self.evaluate(0)})
            self._record(history, tokens, save=False)
        self.draft.train()
        train_seconds, tokens_at_start = 0.0, tokens  # optimizer steps only, not evaluation or checkpoints
        compiled_before = compile_seconds()
        loss_value, reported_at = float("nan"), time.time()
        pending: tuple[int, Callable[[], float], int, float] | None = None  # a step whose loss is read once the next is queued
        columns = [
            TextColumn("distill"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total} steps"),
            TextColumn("loss {task.fields[loss]:.4f}"),
            TimeRemainingColumn(),
        ]
        with Progress(*columns, disable=not self.accelerator.is_main_process) as bar:
            task = bar.add_task("distill", total=cfg.max_steps, completed=step, loss=float("nan"))
            self._say(bar, history)

            def report(done: int, loss: Callable[[], float], step_tokens: int, lr: float, since: float | None = None) -> None:
                """Read a step's loss (waiting for the device to finish that step) and log it, with its rate over the
                time since the last read (since: since the step began, for a step read at once, not one step later)."""
                nonlocal loss_value, reported_at
                loss_value, now = loss(), time.time()
                bar.update(task, loss=loss_value)
                seconds = now - (reported_at if since is None else since)
                self.log(done, {"train_loss": loss_value, "lr": lr, "tokens_per_s": step_tokens / max(seconds, 1e-9)})
                reported_at = now

            while step < cfg.max_steps:
                step_started, step_tokens = time.time(), tokens
                step_loss, counted = self._compiled_or_not(lambda: self._micro_steps(step), step + 1)
                tokens += counted
                with record_function("optimizer"):
                    self.accelerator.clip_grad_norm_(self.trainable, cfg.max_grad_norm)
                    self.optimizer.step()
                    self.scheduler.step()
                    self.optimizer.zero_grad(set_to_none=True)
                step += 1
                bar.update(task, completed=step)
                if pending is not None:  # the last step's loss, read while this one runs: the host never waits idle
                    report(*pending)
                pending = (step, read_later(step_loss), tokens - step_tokens, self.scheduler.get_last_lr()[0])
                evaluating = step % cfg.eval_every == 0 or step == cfg.max_steps
                if evaluating:
                    report(*pending, since=step_started)
                    pending = None
                train_seconds += time.time() - step_started
                if evaluating:
                    history.append({"step": step, "train_loss": loss_value, **self.evaluate(step)})
                    self._record(history, tokens)
                    self._say(bar, history)
                    reported_at = time.time()
        self.kept_step = best_step(history) if cfg.keep_best else step
        return {
            "history": history,
            "kept_step": self.kept_step,
            "train_tokens": tokens,
            "final_train_loss": loss_value,
            "tokens_per_s": (tokens - tokens_at_start) / train_seconds if train_seconds > 0 else 0.0,
            "tokens_this_run": tokens - tokens_at_start,  # not those of a run this one resumed
            "compile_seconds": compile_seconds() - compiled_before,  # within the optimizer steps' time
            **({} if self.compile_failed_at is None else {"compile_failed_at_step": self.compile_failed_at}),
            **self.objective.kept.summary(),
        }

    def _say(self, bar, history: list[dict]) -> None:
        """The latest evaluation's line above the bar (where output is not a terminal the bar shows only at the end)."""
        if self.accelerator.is_main_process:
            bar.console.print(evaluation_line(history, self.cfg.max_steps), soft_wrap=True, markup=False)

    def _record(self, history: list[dict], tokens: int, save: bool = True) -> None:
        """Log an evaluation; with distill.keep_best, keep the student in work_dir/best when it is the best held-out
        one so far (the last step's ships anyway); then (save) a checkpoint."""
        step, student = history[-1]["step"], self.accelerator.unwrap_model(self.draft)
        self.log(step, history[-1])
        if self.accelerator.is_main_process:
            if self.cfg.keep_best and "eval_tvd" in history[-1] and step < self.cfg.max_steps and best_step(history) == step:
                self.objective.save(student, self.work_dir / BEST)
            if save:
                checkpoint.save(
                    self.work_dir, student, self.optimizer, self.scheduler, {"step": step, "history": history, "tokens": tokens}
                )
        self.accelerator.wait_for_everyone()

    def save_draft(self, out_dir: Path) -> None:
        """The student as the objective saves it (an HF dir; an EAGLE-3 head in speculators format): as it was
        at its best held-out evaluation (distill.keep_best), else as it is now."""
        if not self.accelerator.is_main_process:
            return
        if self.kept_step == self.cfg.max_steps:
            self.objective.save(self.accelerator.unwrap_model(self.draft), out_dir)
        else:
            shutil.copytree(self.work_dir / BEST, out_dir, dirs_exist_ok=True)
        shutil.rmtree(self.work_dir / BEST, ignore_errors=True)


def evaluation_line(history: list[dict], max_steps: int) -> str:
    """The latest evaluation as the log shows it: "distill step 20/40: held-out TVD 0.5723 (lowest 0.0202, step 0), ..."."""
    point, parts = history[-1], []
    if "eval_tvd" in point:
        lowest = best_step(history)
        best = next(h for h in history if h["step"] == lowest)
        parts.append(f"held-out TVD {point['eval_tvd']:.4f} (lowest {best['eval_tvd']:.4f}, step {best['step']})")
    parts += [f"{name} {point[key]:.4f}" for key, name in (("eval_loss", "held-out loss"), ("train_loss", "train loss")) if key in point]
    return f"distill step {point['step']}/{max_steps}: " + (", ".join(parts) or "nothing held out to measure")


def best_step(history: list[dict]) -> int:
    """The step of the lowest held-out TVD (the draft's expected rejection rate), the latest of ties; the last
    step when nothing was measured held out."""
    measured = [h for h in history if "eval_tvd" in h]
    if not measured:
        return history[-1]["step"]
    return min(measured, key=lambda h: (h["eval_tvd"], -h["step"]))["step"]
