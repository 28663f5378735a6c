"""Speculative rejection sampling (Leviathan et al. 2023; Chen et al. 2023), apart from proposers.

Draft token d_i drawn from q_i is kept with probability min(1, p_i(d_i) / q_i(d_i)); at the first
rejection the token is redrawn from normalise(max(p_i - q_i, 0)); if all K are kept, a bonus token is
drawn from p_{K+1}. The emitted tokens then follow the target's distribution p exactly.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from draftsmith.serve.sampling import Random, sample, uniform


class Verifier(Protocol):
    def __call__(self, draft_tokens: Tensor, draft_probs: Tensor, target_probs: Tensor, generator: Random) -> tuple[Tensor, Tensor]: ...


def rejection_sample(draft_tokens: Tensor, draft_probs: Tensor, target_probs: Tensor, generator: Random) -> tuple[Tensor, Tensor]:
    """Returns (num_accepted [B], tokens [B, K+1]): tokens[:, :n] are accepted drafts, tokens[:, n] the
    corrected or bonus token; what follows is undefined."""
    B, K = draft_tokens.shape
    p = target_probs[:, :K].gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)  # [B, K]
    q = draft_probs.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)  # [B, K]
    u = uniform((B, K), p.device, generator)
    accepted = (u * q < p).int()  # u < p/q without dividing; q > 0 for drawn tokens
    num_accepted = accepted.cumprod(dim=1).sum(dim=1)  # [B]
    return num_accepted, append_correction(num_accepted, draft_tokens, draft_probs, target_probs, generator)


def append_correction(num_accepted: Tensor, draft_tokens: Tensor, draft_probs: Tensor, target_probs: Tensor, generator: Random) -> Tensor:
    """The step's tokens [B, K+1]: accepted drafts, then a draw from normalise(max(p_n - q_n, 0)) at the
    first rejection n, or from p_{K+1} (the bonus) when all K were accepted."""
    B = draft_tokens.shape[0]
    q_padded = torch.cat([draft_probs, torch.zeros_like(draft_probs[:, :1])], dim=1)  # [B, K+1, V]
    at = num_accepted.view(B, 1, 1).expand(B, 1, target_probs.shape[-1])
    p_n = target_probs.gather(1, at).squeeze(1)  # [B, V]
    residual = (p_n - q_padded.gather(1, at).squeeze(1)).clamp_min(0)  # bonus row: q = 0, so p_{K+1}
    mass = residual.sum(-1, keepdim=True)
    residual = torch.where(mass > 1e-12, residual / mass.clamp_min(1e-12), p_n)  # p == q: nothing to correct
    correction = sample(residual, generator)  # [B]
    tokens = torch.cat([draft_tokens, torch.zeros_like(draft_tokens[:, :1])], dim=1)  # [B, K+1]
    return tokens.scatter_(1, num_accepted.unsqueeze(1), correction.unsqueeze(1))
