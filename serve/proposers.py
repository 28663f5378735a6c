"""Proposers: where the K speculative tokens come from, behind one small interface.

A proposer returns the K tokens it proposes for each row [B, K] and the distributions they were drawn
from [B, K, V] (None when the whole batch is greedy, whose verification needs only the tokens).
`DraftModel` runs a small LM; `PromptLookup` copies what followed the last earlier occurrence of the
sequence's final n-gram (prompt lookup decoding), at no model cost.
"""
from __future__ import annotations

from typing import Protocol, Sequence

import torch
from torch import Tensor

from draftsmith.serve.sampling import RowSampling, probabilities, sample
from draftsmith.serve.speculative import DecodeState, Forward


class Proposer(Protocol):
    reads_history: bool  # whether propose() needs each row's tokens so far

    def propose(self, state: DecodeState, k: int, rows: RowSampling, generator: torch.Generator | None,
                histories: Sequence[Sequence[int]]) -> tuple[Tensor, Tensor | None]: ...


class DraftModel:
    reads_history = False

    def __init__(self, forward: Forward):
        self.forward = forward

    def propose(self, state: DecodeState, k: int, rows: RowSampling, generator: torch.Generator | None,
                histories: Sequence[Sequence[int]] = ()) -> tuple[Tensor, Tensor | None]:
        positions = state.lengths.unsqueeze(1)  # [B, 1]
        # the draft re-reads `previous` with `pending`, so its cache is whole after any rejection
        logits = self.forward(torch.stack([state.previous, state.pending], dim=1), torch.cat([positions - 1, positions], dim=1))
        tokens, probs = [], []
        for i in range(k):
            if rows.all_greedy:
                tokens.append(logits[:, -1:].argmax(-1))  # [B, 1]
            else:
                q = probabilities(logits[:, -1:], rows)  # [B, 1, V]
                tokens.append(sample(q, generator))
                probs.append(q)
            if i + 1 < k:
                logits = self.forward(tokens[-1], positions + i + 1)
        return torch.cat(tokens, dim=1), (torch.cat(probs, dim=1) if probs else None)


def lookup(history: Sequence[int], k: int, max_ngram: int, min_ngram: int) -> list[int]:
    """The K tokens after the latest earlier occurrence of the history's longest final n-gram
    (n from max_ngram down to min_ngram); where fewer follow, or none match, the last token repeats."""
    for n in range(min(max_ngram, len(history) - 1), min_ngram - 1, -1):
        suffix = list(history[-n:])
        for start in range(len(history) - n - 1, -1, -1):  # latest match first, never the suffix itself
            if list(history[start:start + n]) == suffix:
                follow = list(history[start + n:start + n + k])
                return follow + [follow[-1]] * (k - len(follow))
    return [history[-1]] * k


class PromptLookup:
    reads_history = True

    def __init__(self, vocab_size: int, max_ngram: int = 3, min_ngram: int = 1):
        self.vocab_size, self.max_ngram, self.min_ngram = vocab_size, max_ngram, min_ngram

    def propose(self, state: DecodeState, k: int, rows: RowSampling, generator: torch.Generator | None,
                histories: Sequence[Sequence[int]] = ()) -> tuple[Tensor, Tensor | None]:
        device = state.lengths.device
        tokens = torch.tensor([lookup(h, k, self.max_ngram, self.min_ngram) for h in histories], device=device)  # [B, K]
        if rows.all_greedy:
            return tokens, None
        # a deterministic proposal is a draw from a one-hot q: kept with probability p(token)
        return tokens, torch.nn.functional.one_hot(tokens, self.vocab_size).float()  # [B, K, V]
