"""One decoding step, speculative or plain, over a batch of sequences.

State per row: `lengths` tokens are in the target's cache; `pending` is the last emitted token, not
yet fed to the target (it sits at position `lengths`); `previous` is the token at `lengths - 1`.
The draft re-reads `previous` with `pending` in its first forward, so its cache is complete whether
or not the last step accepted every draft token, and every step has the same shapes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from draftsmith.serve.rejection import Verifier, rejection_sample
from draftsmith.serve.sampling import RowSampling, probabilities, sample

# (tokens [B, T], positions [B, T]) -> logits [B, T, V]
Forward = Callable[[Tensor, Tensor], Tensor]


@dataclass
class DecodeState:
    lengths: Tensor  # [B]
    pending: Tensor  # [B]
    previous: Tensor  # [B]

    def advance(self, active: Tensor, num_accepted: Tensor, fed: Tensor, emitted: Tensor) -> None:
        """Move active rows past their accepted tokens; finished rows stay where they are.
        fed [B, K+1]: the tokens the target read this step; emitted [B, K+1]: the step's output."""
        at = num_accepted.unsqueeze(1)  # [B, 1]
        self.lengths = torch.where(active, self.lengths + num_accepted + 1, self.lengths)
        self.previous = torch.where(active, fed.gather(1, at).squeeze(1), self.previous)
        self.pending = torch.where(active, emitted.gather(1, at).squeeze(1), self.pending)


@dataclass
class StepOutput:
    num_accepted: Tensor  # [B], 0 for a plain step
    tokens: Tensor  # [B, K+1]: tokens[:, :num_accepted + 1] are emitted
    target_logits: Tensor  # [B, K+1, V], for logprobs


def propose(draft: Forward, state: DecodeState, k: int, rows: RowSampling,
            generator: torch.Generator | None) -> tuple[Tensor, Tensor | None]:
    """The draft's K tokens [B, K] and the distributions they were drawn from [B, K, V]
    (None for an all-greedy batch, whose verification needs only the tokens)."""
    positions = state.lengths.unsqueeze(1)  # [B, 1]
    logits = draft(torch.stack([state.previous, state.pending], dim=1), torch.cat([positions - 1, positions], dim=1))
    tokens, probs = [], []
    for i in range(k):
        if rows.all_greedy:
            tokens.append(logits[:, -1:].argmax(-1))  # [B, 1]
        else:
            q = probabilities(logits[:, -1:], rows)  # [B, 1, V]
            tokens.append(sample(q, generator))
            probs.append(q)
        if i + 1 < k:
            logits = draft(tokens[-1], positions + i + 1)
    return torch.cat(tokens, dim=1), (torch.cat(probs, dim=1) if probs else None)


def speculative_step(target: Forward, draft: Forward, state: DecodeState, k: int, rows: RowSampling,
                     generator: torch.Generator | None, verify: Verifier = rejection_sample) -> StepOutput:
    draft_tokens, draft_probs = propose(draft, state, k, rows, generator)  # [B, K], [B, K, V]
    fed = torch.cat([state.pending.unsqueeze(1), draft_tokens], dim=1)  # [B, K+1]
    positions = state.lengths.unsqueeze(1) + torch.arange(k + 1, device=fed.device)  # [B, K+1]
    target_logits = target(fed, positions)  # [B, K+1, V]: all K+1 positions in one forward
    if draft_probs is None:  # greedy: keep drafts while they equal the target's argmax, which also
        target_tokens = target_logits.argmax(-1)  # gives the correction or bonus token  [B, K+1]
        num_accepted = (draft_tokens == target_tokens[:, :k]).int().cumprod(dim=1).sum(dim=1)
        return StepOutput(num_accepted, target_tokens, target_logits)
    num_accepted, tokens = verify(draft_tokens, draft_probs, probabilities(target_logits, rows), generator)
    return StepOutput(num_accepted, tokens, target_logits)


def plain_step(target: Forward, state: DecodeState, rows: RowSampling, generator: torch.Generator | None) -> StepOutput:
    target_logits = target(state.pending.unsqueeze(1), state.lengths.unsqueeze(1))  # [B, 1, V]
    if rows.all_greedy:  # the one-hot distribution's sample is the argmax: skip building it
        tokens = target_logits.argmax(-1)  # [B, 1]
    else:
        tokens = sample(probabilities(target_logits, rows), generator)
    return StepOutput(torch.zeros_like(state.lengths), tokens, target_logits)


def fed_tokens(state: DecodeState, out: StepOutput) -> Tensor:
    """The tokens the target read in the step [B, K+1]: pending, then the accepted drafts."""
    return torch.cat([state.pending.unsqueeze(1), out.tokens[:, :-1]], dim=1)
