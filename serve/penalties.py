"""Logit bias and the repetition, frequency and presence penalties, as vLLM applies them.

vLLM's order and definitions: logit_bias is added; then the repetition penalty, on every token of the
prompt or the output so far (a positive logit divided by it, a negative one multiplied); then the
frequency penalty (minus penalty x the token's count in the output) and the presence penalty (minus
penalty where that count is positive); temperature, min-p, top-k and top-p follow (serve/sampling.py).

A speculative step verifies K + 1 positions at once: the target's logits at position t are penalised
as if the step's first t drafts were already output, which is what they are where the target keeps
them; the draft's logits are penalised the same way as it proposes. So the penalised distribution is
what rejection sampling keeps exactly, and greedy speculative output equals plain greedy output with the
same penalties.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from draftsmith.serve.sampling import SamplingParams


@dataclass
class Penalties:
    presence: Tensor  # [B, 1, 1]
    frequency: Tensor  # [B, 1, 1]
    repetition: Tensor  # [B, 1, 1]
    bias: Tensor  # [B, 1, V]
    in_prompt: Tensor  # [B, V] bool
    counts: Tensor  # [B, V] float32: each token's count in the output so far

    @classmethod
    def of(
        cls, params: Sequence[SamplingParams], prompts: Sequence[Sequence[int]], vocab_size: int, device: torch.device | str
    ) -> "Penalties | None":
        """The penalties of a batch's rows (None when no row has any): the prompts read, nothing output yet."""
        if not any(p.penalised for p in params):
            return None
        scalar = lambda name: torch.tensor([getattr(p, name) for p in params], dtype=torch.float32).view(-1, 1, 1).to(device)
        bias = torch.zeros(len(params), 1, vocab_size)
        in_prompt = torch.zeros(len(params), vocab_size, dtype=torch.bool)
        for i, (p, prompt) in enumerate(zip(params, prompts)):
            for token, value in p.logit_bias:
                bias[i, 0, token] = value
            if p.repetition_penalty != 1.0:
                in_prompt[i, torch.tensor(list(prompt), dtype=torch.long)] = True
        return cls(
            scalar("presence_penalty"),
            scalar("frequency_penalty"),
            scalar("repetition_penalty"),
            bias.to(device),
            in_prompt.to(device),
            torch.zeros(len(params), vocab_size, device=device),
        )

    @classmethod
    def none(cls, batch: int, vocab_size: int, device: torch.device | str) -> "Penalties":
        """`batch` rows without penalties (a scheduler's batch, before requests take its rows)."""
        full = lambda value: torch.full((batch, 1, 1), value, device=device)
        return cls(
            full(0.0),
            full(0.0),
            full(1.0),
            torch.zeros(batch, 1, vocab_size, device=device),
            torch.zeros(batch, vocab_size, dtype=torch.bool, device=device),
            torch.zeros(batch, vocab_size, device=device),
        )

    def apply(self, logits: Tensor, drafts: Tensor | None = None) -> Tensor:
        """Penalised logits [B, T, V] (float32) from logits [B, T, V]; position t follows the output so far
        and then the first D - T + 1 + t of `drafts` [B, D] (a verification: D = K, T = K + 1; a draft's
        proposal: T = 1 after all D drafts so far)."""
        counts = self.counts.unsqueeze(1)  # [B, 1, V]
        T = logits.shape[1]
        if drafts is not None and drafts.shape[1]:
            ahead = F.one_hot(drafts, counts.shape[-1]).float().cumsum(1)  # [B, D, V]
            ahead = torch.cat([torch.zeros_like(ahead[:, :1]), ahead], dim=1)[:, drafts.shape[1] - T + 1 :]  # [B, T, V]
            counts = counts + ahead
        x = logits.float() + self.bias
        seen = (counts > 0) | self.in_prompt.unsqueeze(1)
        x = torch.where(seen, torch.where(x > 0, x / self.repetition, x * self.repetition), x)
        return x - self.frequency * counts - self.presence * (counts > 0)

    def record(self, tokens: Tensor, num_accepted: Tensor, active: Tensor) -> None:
        """Count the tokens a step emitted (tokens [B, K+1], the first num_accepted + 1 of each active row)."""
        kept = (torch.arange(tokens.shape[1], device=tokens.device) <= num_accepted.unsqueeze(1)) & active.unsqueeze(1)
        self.counts.scatter_add_(1, tokens, kept.float())

    def record_first(self, tokens: Tensor) -> None:
        """Count each row's first token [B], sampled after its prompt."""
        self.counts.scatter_add_(1, tokens.unsqueeze(1), torch.ones_like(self.counts[:, :1]))

    def rows(self, n: int) -> "Penalties":
        """Views of the first n rows: recording into them records into this batch."""
        return Penalties(*(getattr(self, f.name)[:n] for f in fields(self)))

    def set_row(self, row: int, other: "Penalties | None", source: int = 0) -> None:
        """Row `row` takes row `source` of `other` (a joining request's), or no penalties."""
        for f in fields(self):
            mine = getattr(self, f.name)
            if other is None:
                mine[row] = 1.0 if f.name == "repetition" else 0
            else:
                mine[row] = getattr(other, f.name)[source]
