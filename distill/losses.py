"""Distillation losses between the target's distribution p and the draft's q, per position.

Each divergence takes log-probabilities over the same C outcomes: the full vocabulary (online target
logits) or the target's top-k tokens plus one bucket for the remaining tail mass (the logit cache).
TVD is what acceptance measures: a draft token drawn from q is accepted with probability 1 - TVD(p, q).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

_TINY = 1e-12


def forward_kl(logp: Tensor, logq: Tensor) -> Tensor:
    """KL(p || q) per row: [N, C] -> [N]."""
    return (logp.exp() * (logp - logq)).sum(-1)


def reverse_kl(logp: Tensor, logq: Tensor) -> Tensor:
    """KL(q || p) per row."""
    return (logq.exp() * (logq - logp)).sum(-1)


def jsd(logp: Tensor, logq: Tensor, beta: float) -> Tensor:
    """Generalised Jensen-Shannon: beta KL(p || m) + (1 - beta) KL(q || m), m = beta p + (1 - beta) q."""
    logm = torch.logsumexp(torch.stack([logp + torch.log(torch.tensor(beta)), logq + torch.log(torch.tensor(1 - beta))]), dim=0)
    return beta * forward_kl(logp, logm) + (1 - beta) * forward_kl(logq, logm)


def tvd(logp: Tensor, logq: Tensor) -> Tensor:
    """Total variation distance: 0.5 sum |p - q|."""
    return 0.5 * (logp.exp() - logq.exp()).abs().sum(-1)


def divergence(name: str, logp: Tensor, logq: Tensor, beta: float = 0.5) -> Tensor:
    if name == "forward_kl":
        return forward_kl(logp, logq)
    if name == "reverse_kl":
        return reverse_kl(logp, logq)
    if name == "jsd":
        return jsd(logp, logq, beta)
    if name == "tvd":
        return tvd(logp, logq)
    raise ValueError(f"unknown divergence {name!r}")


def with_tail(log_probs_topk: Tensor) -> Tensor:
    """Append the tail bucket log(1 - sum top-k) to top-k log-probabilities: [N, k] -> [N, k+1]."""
    tail = torch.log1p(-log_probs_topk.exp().sum(-1).clamp(max=1 - 1e-6))
    return torch.cat([log_probs_topk, tail.unsqueeze(-1)], dim=-1)


def bucketed(student_logits: Tensor, topk_ids: Tensor, topk_logprobs: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    """(log p, log q) over the target's top-k tokens plus the tail, at `temperature`.

    The draft's buckets are exact. The target's tail is known only as one mass, so at T != 1 it is
    tempered as if it were one token (exact at T = 1)."""
    logq = with_tail(F.log_softmax(student_logits.float() / temperature, dim=-1).gather(-1, topk_ids.long()))
    logp = F.log_softmax(with_tail(topk_logprobs.float()) / temperature, dim=-1)
    return logp, logq


def full(student_logits: Tensor, target_logits: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    """(log p, log q) over the whole vocabulary, at `temperature`."""
    return (F.log_softmax(target_logits.float() / temperature, dim=-1),
            F.log_softmax(student_logits.float() / temperature, dim=-1))


def hard_label(student_logits: Tensor, labels: Tensor) -> Tensor:
    """Cross-entropy on the teacher's sampled tokens, per position."""
    return F.cross_entropy(student_logits.float(), labels, reduction="none")
