"""EAGLE-3 heads: the draft vocabulary, a head built for the target, and training-time test.

Training runs the target online: its hidden states entering the head's layers (vLLM's aux hidden state
layer ids) and its logits over the draft vocabulary, per position of prompt + teacher response. The
head is then unrolled `ttt_steps` times over the whole sequence at once, as it runs at inference
(serve/eagle.py): step 0's entry t reads the token at t + 1 and the target's fused hidden state at t
and predicts the token at t + 2; step j's entry t stands for position t + j, reads the token at
t + j + 1 (teacher-forced: a draft is only ever continued where the previous ones were accepted, i.e.
equal to the target's tokens) and its own step j - 1 output, and attends to step 0's entries up to t
plus its own earlier steps (the diagonal), exactly the cache an inference step sees. Step j's loss is
the configured divergence to the target's distribution at position t + j + 1, over response positions,
weighted by ttt_decay^j.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.profiler import record_function

from draftsmith.distill import losses
from draftsmith.serve.eagle import EagleHead, HeadShape, default_aux_layers, layer_config_of
from draftsmith.serve.model import ModelArgs
from draftsmith.serve.proposers import VOCAB_FILE
from draftsmith.serve.weights import read_config


class EagleConfigError(ValueError):
    """An EAGLE-3 head that cannot be built as configured; the message names the key."""


def draft_vocabulary(token_lists: Iterable[list[int]], vocab_size: int, size: int) -> list[int]:
    """The `size` most frequent token ids of the teacher data, ascending; where the data has fewer
    distinct tokens, the lowest unseen ids fill up (BPE gives frequent tokens low ids). size <= 0 or
    >= vocab_size: the whole vocabulary."""
    if size <= 0 or size >= vocab_size:
        return list(range(vocab_size))
    return _most_frequent(Counter(t for tokens in token_lists for t in tokens), vocab_size, size)


def _most_frequent(counts: Counter, vocab_size: int, size: int) -> list[int]:
    chosen = {t for t, _ in counts.most_common(size)}
    filler = (t for t in range(vocab_size) if t not in chosen)
    while len(chosen) < size:
        chosen.add(next(filler))
    return sorted(chosen)


def coverage(token_lists: Iterable[list[int]], vocab: list[int]) -> float:
    """The share of the tokens that the draft vocabulary holds (an upper bound on acceptance)."""
    members = set(vocab)
    tokens = [t for tokens in token_lists for t in tokens]
    return sum(t in members for t in tokens) / max(1, len(tokens))


COVERAGE_SIZES = (1024, 2048, 4096, 8192, 16384, 32768)


def coverage_by_size(train_lists: list[list[int]], eval_lists: list[list[int]], vocab_size: int) -> dict[str, float]:
    """The held-out coverage of the draft vocabulary chosen from the training answers, at each of COVERAGE_SIZES
    smaller than the target's vocabulary: what a larger or smaller draft vocabulary would lose or win, at most."""
    counts = Counter(t for tokens in train_lists for t in tokens)  # counted once for every size
    held = Counter(t for tokens in eval_lists for t in tokens)
    total = max(1, sum(held.values()))
    return {
        str(size): round(sum(held[t] for t in _most_frequent(counts, vocab_size, size)) / total, 4)
        for size in COVERAGE_SIZES
        if size < vocab_size
    }


def write_vocab(out_dir: Path, vocab: list[int], covered: float) -> None:
    (out_dir / VOCAB_FILE).write_text(json.dumps({"size": len(vocab), "coverage": covered, "token_ids": vocab}))


def resolve_aux_layers(configured: list[int], num_target_layers: int) -> tuple[int, ...]:
    layers = tuple(configured) or default_aux_layers(num_target_layers)
    bad = [i for i in layers if not 0 <= i < num_target_layers]
    if bad:
        raise EagleConfigError(
            f"draft.aux_layers={list(configured)}: {bad} are not layers of the target "
            f"(0 to {num_target_layers - 1}); [] picks an early, a middle and a late one"
        )
    return layers


def build_head(target_dir: Path, num_layers: int, aux_layers: tuple[int, ...], vocab: list[int], seed: int) -> tuple[EagleHead, dict]:
    """A new head for the target (float32): decoder layers initialised at random like HF models; the
    final norm and the LM head rows of the draft vocabulary copied from the target. Returns the head and
    its layer config (for the checkpoint)."""
    from draftsmith.serve.weights import read_safetensors

    config = read_config(target_dir)
    layer_config = layer_config_of(config, num_layers)
    args = ModelArgs.from_hf_config(layer_config)
    torch.manual_seed(seed)
    head = EagleHead(args, HeadShape(aux_layers, config["hidden_size"], len(vocab)))
    std = config.get("initializer_range", 0.02)
    for module in head.modules():
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, 0.0, std)
    tensors = read_safetensors(target_dir)
    lm_head = tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"])
    ids = torch.tensor(vocab)
    with torch.no_grad():
        head.lm_head.weight.copy_(lm_head[ids].float())
        head.norm.weight.copy_(tensors["model.norm.weight"].float())
    head.vocab = ids
    return head, layer_config


def loss_chunk(tokens: int, target_vocab: int, draft_vocab: int) -> int:
    """Rows a chunk of the head's loss (distill.loss_chunk_size counts tokens over the target's vocabulary): as
    many logits a chunk over the draft vocabulary, so fewer chunks, each launched from the host, make a step."""
    return tokens * max(1, target_vocab // draft_vocab)


@dataclass(frozen=True)
class UnrollIndex:
    """Where a batch's response positions sit in each step of training-time test, as index tensors made on the
    host from the rows' lengths, so that gathering by them never waits on the device (a boolean mask would:
    its count is only known there). Step j's entry t stands for position t + j + 1 and predicts the token
    after it, so the batch's response positions s give step j's entries t = s - j - 1 (those with s > j).
    The steps after the first run only at each row's window of entries that some such step reads (from
    `steps` before its first response position to its last), not at its prompt or padding."""

    entries: tuple[Tensor, ...]  # step j: flat indices into [B * E] of its entries, in `labels` order
    picks: tuple[Tensor | None, ...]  # step j: which of the batch's N response positions those are (None: all N)
    window: Tensor  # [B, W]: each row's window of entries (past a row's own, repeats of its last)
    at: tuple[Tensor, ...]  # step j: its entries' flat indices into its hidden states ([B * E] at step 0, [B * W] after)

    @classmethod
    def of(cls, batch, steps: int) -> "UnrollIndex":
        from draftsmith.serve.sampling import to_device

        E = batch.input_ids.shape[1] - 1
        starts = np.array([len(row["prompt_ids"]) - 1 for row in batch.sources])  # a row's first response position
        rows = np.repeat(np.arange(len(starts)), batch.counts)
        s = np.concatenate([np.arange(start, start + n) for start, n in zip(starts, batch.counts)])
        low = np.maximum(starts - steps, 0)  # a row's first entry that a step after the first reads
        width = max(1, int((starts + np.array(batch.counts) - 1 - low).max()))
        window = np.minimum(low[:, None] + np.arange(width), E - 1)
        device = batch.input_ids.device
        entries, picks, at = [], [], []
        for j in range(steps):
            keep = s > j
            r, t = rows[keep], s[keep] - j - 1
            entries.append(to_device(torch.from_numpy(r * E + t), device))
            at.append(entries[-1] if j == 0 else to_device(torch.from_numpy(r * width + t - low[r]), device))
            picks.append(None if keep.all() else to_device(torch.from_numpy(np.flatnonzero(keep)), device))
        return cls(tuple(entries), tuple(picks), to_device(torch.from_numpy(window), device), tuple(at))


class UnrolledHead(nn.Module):
    """The head unrolled for training: forward returns the loss and, when asked, per-step metrics (a module of
    its own so that data-parallel training sees one forward). The token embedding is the target's, frozen.
    The unroll (every step's layers and final norm) is two functions that distill.compile compiles: step 0,
    whose attention stays outside compiled code, and the later steps, one graph; the loss over the draft
    vocabulary runs chunk by chunk after it (distill.loss_chunk_size). On CUDA the compiled later steps attend
    through FlexAttention (serve/eagle.py flex_window_attention: faster than the written-out attention, and
    smaller, as benchmarks/profile_train.py measures); elsewhere, and eagerly, written out.
    windowed=False runs every step at every entry, eagerly (the same loss and gradient, more work: the unroll's
    definition, for comparison)."""

    def __init__(self, head: EagleHead, embeddings: nn.Embedding, steps: int, decay: float, chunk: int = 0, windowed: bool = True):
        super().__init__()
        self.head, self.steps, self.decay, self.chunk, self.windowed = head, steps, decay, chunk, windowed
        self.__dict__["embeddings"] = embeddings  # not a submodule: not trained, not checkpointed
        self.__dict__["compiled"] = None  # distill.compile: (step 0, the later steps), compiled by compile_training

    def compile_training(self, on: bool = True) -> None:
        """torch.compile the windowed unroll's two parts (dynamic shapes: rows differ in length batch to batch), for
        training steps: held-out passes run them eagerly, as a no-grad call would compile them a second time.
        on=False: eagerly again, attention written out (the trainer's way on where compiling failed)."""
        self.__dict__["compiled"] = (torch.compile(self._first, dynamic=True), torch.compile(self._later, dynamic=True)) if on else None

    def _read(self, hidden: Tensor, where: Tensor) -> Tensor:
        """A step's normalised hidden states [B, E or W, hidden] at its flat entries `where` (what the LM head reads)."""
        return self.head.norm(hidden.flatten(0, 1).index_select(0, where))

    def _first(self, tokens: Tensor, features: Tensor, where: Tensor) -> tuple[Tensor, Tensor, list[tuple[Tensor, Tensor]]]:
        """(Step 0's states read at its entries `where` [N_0, hidden]; its hidden states and keys and values, what the
        later steps read)."""
        hidden, first = self.head.first_step(tokens, features, self.embeddings)
        return self._read(hidden, where), hidden, first

    def _later(
        self, hidden: Tensor, first: list, tokens: Tensor, window: Tensor, at: tuple[Tensor, ...], flex: bool = False
    ) -> list[Tensor]:
        """Steps 1 and later's states read at their entries `at[j]` (into [B * W]); flex: attending through FlexAttention."""
        steps = self.head.later_steps(hidden, first, tokens, self.embeddings, self.steps, window, flex)
        return [self._read(h, where) for where, h in zip(at, steps)]

    def _states(self, tokens: Tensor, features: Tensor, index: UnrollIndex) -> list[Tensor]:
        """Step j's normalised hidden states at its entries [N_j, hidden]."""
        if not self.windowed:
            unrolled = self.head.unroll(tokens, features, self.embeddings, self.steps)
            return [self._read(h, where) for where, h in zip(index.entries, unrolled)]
        compiled = self.compiled is not None and torch.is_grad_enabled()  # held-out passes: no second compilation
        first, later = self.compiled if compiled else (self._first, self._later)
        normed, hidden, kv = first(tokens, features, index.at[0])
        return [normed, *later(hidden, kv, tokens, index.window, index.at[1:], compiled and hidden.is_cuda)]

    def forward(
        self, tokens: Tensor, features: Tensor, target_logits: Tensor, index: UnrollIndex, loss_fn, labels: Tensor | None = None
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """tokens [B, S]; features [B, S, F] (the target's hidden states at each position); target_logits [N, V_draft]
        (the target's at the batch's N response positions, over the draft vocabulary); loss_fn(student_logits [n, V'],
        target_logits [n, V']) -> [n]. labels [N] (the data's next tokens): also count, per step, the entries whose
        drafts up to it all equal the data's tokens (for a greedy teacher, what the target accepts)."""
        weight = self.head.lm_head.weight
        loss = weight.new_zeros((), dtype=torch.float32)
        metrics: dict[str, Tensor] = {}
        correct = None  # [B * E]: every step so far agreed
        for j, hidden in enumerate(self._states(tokens, features, index)):
            p = target_logits if index.picks[j] is None else target_logits.index_select(0, index.picks[j])
            q = None
            if self.chunk > 0 and torch.is_grad_enabled():  # training: the logits never whole
                step_loss = losses.chunked_mean(hidden, weight, lambda z, rows, p=p: loss_fn(z, p[rows]), self.chunk)
            else:  # evaluating (no gradient): the logits once, for the loss and the counts
                q = F.linear(hidden, weight)
                step_loss = loss_fn(q, p).mean()
            loss = loss + self.decay**j * step_loss
            if labels is not None:
                with torch.no_grad():
                    q = F.linear(hidden, weight) if q is None else q
                    wanted = labels if index.picks[j] is None else labels.index_select(0, index.picks[j])
                    agree = torch.zeros(tokens.shape[0] * (tokens.shape[1] - 1), dtype=torch.bool, device=tokens.device)
                    agree.index_copy_(0, index.entries[j], self.head.vocab[q.argmax(-1)] == wanted)
                    correct = agree if correct is None else correct & agree
                    if j == 0:
                        metrics["tvd_0"] = losses.tvd(*losses.full(q, p, 1.0)).sum()
                    metrics[f"accepted_{j}"] = correct.sum().float()
                    metrics[f"drafted_{j}"] = torch.tensor(float(len(index.entries[j])))
        return loss / sum(self.decay**j for j in range(self.steps)), metrics


def tau_of(metrics: dict[str, float], steps: int) -> dict[str, float]:
    """From summed per-step counts: alpha at K = 1 and the mean accepted length tau at K = steps, where a
    draft counts as kept when it and every earlier one equal the data's next tokens (for a greedy
    teacher, exactly what the target accepts at T = 0)."""
    drafted = metrics.get("drafted_0", 0.0) or 1.0
    kept = [metrics.get(f"accepted_{j}", 0.0) / drafted for j in range(steps)]  # P(first j+1 drafts all kept)
    return {"eval_alpha_1": kept[0], f"eval_tau_{steps}": 1.0 + sum(kept)}


class EagleObjective:
    """Training objective of an EAGLE-3 head (see the module's docstring); the target runs online, its states
    at fixed rows kept after the first forward (distill.target_states_gib)."""

    online = True
    packs = False  # the unrolled head's attention spans its row

    def __init__(self, cfg, aux_layers: tuple[int, ...], vocab: list[int], layer_config: dict, verifier: dict):
        from draftsmith.distill.train import KeptStates

        self.cfg, self.aux_layers, self.layer_config, self.verifier = cfg, aux_layers, layer_config, verifier
        self.vocab = torch.tensor(vocab)
        # over the draft vocabulary
        self.loss_fn = losses.against_logits(cfg.loss.value, cfg.temperature, cfg.jsd_beta, compiled=cfg.compile)
        self.kept = KeptStates(cfg.target_states_gib * 2**30, cfg.max_seq_len)

    @torch.no_grad()
    def target_outputs(self, target, batch) -> tuple[Tensor, Tensor]:
        """The target's hidden states entering the aux layers at every position [B, S, F] and its logits over the
        draft vocabulary at the batch's response positions [N, V']. A kept row's states (features and final
        states, [S_row, F + H]) come from the first forward over it; its padding reads zeros, which no position
        that counts attends to (right padding, causal attention)."""
        parts = self.kept.rows(batch, lambda b: self.row_states(target, b))
        states = torch.nn.utils.rnn.pad_sequence(parts, batch_first=True)  # [B, S, F + H]
        width = states.shape[-1] - target.config.hidden_size
        self.vocab = self.vocab.to(batch.input_ids.device)
        head_rows = target.get_output_embeddings().weight[self.vocab]  # [V', hidden]
        final = states[..., width:].flatten(0, 1).index_select(0, batch.predict_index)
        return states[..., :width], F.linear(final, head_rows)

    def row_states(self, target, batch) -> list[Tensor]:
        """The target's forward over the batch: each row's features and final states at its own positions."""
        out = target.model(**batch.inputs(), output_hidden_states=True)
        states = torch.cat([*(out.hidden_states[i] for i in self.aux_layers), out.last_hidden_state], dim=-1)
        return [states[b, :length] for b, length in enumerate(batch.attention_mask.sum(-1).tolist())]

    def keep_target_states(self, rows) -> None:
        """Keep the target's features and final states of these rows from their first forward on, every
        position of each (distill.target_states_gib; a multiple of a draft model's final states at response
        positions, so fewer rows fit)."""
        self.kept.keep(rows)

    def loss(self, student, target, batch) -> Tensor:
        with record_function("target forward"):  # names in benchmarks/profile_train.py --profile
            features, logits = self.target_outputs(target, batch)
        with record_function("draft forward"):
            loss, _ = student(
                batch.input_ids, features, logits, UnrollIndex.of(batch, getattr(student, "module", student).steps), self.loss_fn
            )
        return loss

    @torch.no_grad()
    def held_out(self, student, target, rows: list[dict], device) -> dict[str, float]:
        """Held-out loss, TVD at the first position (over the draft vocabulary) and teacher-forced greedy
        acceptance: alpha at K = 1 and tau at K = ttt_steps."""
        from draftsmith.distill.train import collate

        self.kept.keep(rows)  # the held-out split is the same at every evaluation
        totals: dict[str, float] = {}
        loss_sum = 0.0
        for i in range(0, len(rows), self.cfg.batch_size):
            batch = collate(rows[i : i + self.cfg.batch_size], self.cfg.max_seq_len, torch.device(device))
            features, logits = self.target_outputs(target, batch)
            loss, metrics = student(batch.input_ids, features, logits, UnrollIndex.of(batch, student.steps), self.loss_fn, batch.labels)
            loss_sum += loss.item() * metrics["drafted_0"].item()
            for name, value in metrics.items():
                totals[name] = totals.get(name, 0.0) + value.item()
        drafted = totals["drafted_0"] or 1.0
        return {"eval_loss": loss_sum / drafted, "eval_tvd": totals["tvd_0"] / drafted, **tau_of(totals, student.steps)}

    def save(self, student, out_dir: Path) -> None:
        from draftsmith.serve.eagle import save_head

        save_head(student.head, out_dir, self.layer_config, self.verifier, student.steps)
