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
from pathlib import Path
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

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
    counts = Counter(t for tokens in token_lists for t in tokens)
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


class UnrolledHead(nn.Module):
    """The head unrolled for training: forward returns the loss and per-step metrics (a module of its
    own so that data-parallel training sees one forward). The token embedding is the target's, frozen."""

    def __init__(self, head: EagleHead, embeddings: nn.Embedding, steps: int, decay: float):
        super().__init__()
        self.head, self.steps, self.decay = head, steps, decay
        self.__dict__["embeddings"] = embeddings  # not a submodule: not trained, not checkpointed

    def forward(
        self, tokens: Tensor, features: Tensor, target_logits: Tensor, predict: Tensor, loss_fn
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """tokens [B, S]; features [B, S, F] (the target's hidden states at each position); target_logits
        [B, S, V_draft] (the target's, over the draft vocabulary); predict [B, S] (positions whose next
        token is a response token). loss_fn(student_logits [N, V'], target_logits [N, V']) -> [N]."""
        head = self.head
        B, S = tokens.shape
        E = S - 1  # entries 0 .. S-2: entry t reads the token at t + 1
        loss = head.fc.weight.new_zeros(())
        correct = torch.ones(B, E, dtype=torch.bool, device=tokens.device)  # every earlier step agreed
        metrics: dict[str, Tensor] = {}
        weights = 0.0
        for j, hidden in enumerate(head.unroll(tokens, features, self.embeddings, self.steps)):
            # step j's entry t predicts the token at t + j + 2 from the target's distribution at t + j + 1
            wanted = F.pad(predict[:, j + 1 :], (0, j))  # [B, E]
            p = F.pad(target_logits[:, j + 1 :], (0, 0, 0, j))[wanted]  # [N, V']
            q = head.logits(hidden[wanted])  # [N, V']
            per_position = loss_fn(q, p)
            if j == 0:
                metrics["tvd_0"] = losses.tvd(*losses.full(q.detach(), p, 1.0)).sum()
            weight = self.decay**j
            loss = loss + weight * per_position.mean()
            weights += weight
            # agreement with the token that follows in the data (the target's greedy token for a greedy teacher)
            agree = torch.zeros_like(correct)
            agree[wanted] = head.vocab[q.argmax(-1)] == F.pad(tokens[:, j + 2 :], (0, j + 1))[wanted]
            correct = correct & agree
            metrics[f"accepted_{j}"] = (correct & wanted).sum().float()
            metrics[f"drafted_{j}"] = wanted.sum().float()
        return loss / weights, metrics


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
        self.loss_fn = losses.against_logits(cfg.loss.value, cfg.temperature, cfg.jsd_beta)  # over the draft vocabulary
        self.kept = KeptStates(cfg.target_states_gib * 2**30)

    @torch.no_grad()
    def target_outputs(self, target, batch) -> tuple[Tensor, Tensor]:
        """The target's hidden states entering the aux layers [B, S, F] and its logits over the draft
        vocabulary [B, S, V'] at every position. A kept row's states (features and final states, [S_row, F + H])
        come from the first forward over it; its padding reads zeros, which no position that counts attends to
        (right padding, causal attention)."""
        parts = self.kept.rows(batch, lambda: self.row_states(target, batch))
        states = torch.nn.utils.rnn.pad_sequence(parts, batch_first=True)  # [B, S, F + H]
        width = states.shape[-1] - target.config.hidden_size
        self.vocab = self.vocab.to(batch.input_ids.device)
        head_rows = target.get_output_embeddings().weight[self.vocab]  # [V', hidden]
        return states[..., :width], F.linear(states[..., width:], head_rows)

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
        features, logits = self.target_outputs(target, batch)
        loss, _ = student(batch.input_ids, features, logits, batch.predict, self.loss_fn)
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
            loss, metrics = student(batch.input_ids, features, logits, batch.predict, self.loss_fn)
            loss_sum += loss.item() * metrics["drafted_0"].item()
            for name, value in metrics.items():
                totals[name] = totals.get(name, 0.0) + value.item()
        drafted = totals["drafted_0"] or 1.0
        return {"eval_loss": loss_sum / drafted, "eval_tvd": totals["tvd_0"] / drafted, **tau_of(totals, student.steps)}

    def save(self, student, out_dir: Path) -> None:
        from draftsmith.serve.eagle import save_head

        save_head(student.head, out_dir, self.layer_config, self.verifier, student.steps)
