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
    return (F.log_softmax(target_logits.float() / temperature, dim=-1), F.log_softmax(student_logits.float() / temperature, dim=-1))


def against_logits(name: str, temperature: float, beta: float, compiled: bool = False):
    """loss_fn(student_logits, target_logits) -> [N]: the divergence `name` (or hard_label: cross-entropy on
    the target's argmax) between the two models' logits, over the same columns. compiled: through
    torch.compile, which fuses the float32 upcasts, both log-softmaxes, the divergence and, under autograd,
    its gradient into a few passes over the [N, V] logits instead of one kernel per operation."""

    def loss_fn(student_logits: Tensor, target_logits: Tensor) -> Tensor:
        if name == "hard_label":
            return hard_label(student_logits, target_logits.argmax(-1))
        return divergence(name, *full(student_logits, target_logits, temperature), beta)

    return torch.compile(loss_fn, dynamic=True) if compiled else loss_fn


def hard_label(student_logits: Tensor, labels: Tensor) -> Tensor:
    """Cross-entropy on the teacher's sampled tokens, per position."""
    return F.cross_entropy(student_logits.float(), labels, reduction="none")


def chunked_mean(hidden: Tensor, weight: Tensor, per_position, chunk: int) -> Tensor:
    """The mean over rows of per_position(logits[rows], rows), where logits = hidden @ weight.T ([N, V])
    are built `chunk` rows at a time and never whole: each chunk's gradient is taken as its loss is, and
    kept as gradients of `hidden` [N, H] and `weight` [V, H] instead of as [N, V] logits. Numerically the
    same as per_position(hidden @ weight.T, all rows).mean(), at a fraction of the memory traffic."""
    return _ChunkedMean.apply(hidden, weight, per_position, chunk)


class _ChunkedMean(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, per_position, chunk: int) -> Tensor:
        n = hidden.shape[0]
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        total = hidden.new_zeros((), dtype=torch.float32)
        for start in range(0, n, chunk):
            rows = slice(start, min(n, start + chunk))
            h = hidden[rows]
            logits = F.linear(h, weight)  # in the ambient autocast dtype, as the model's own LM head would be
            with torch.enable_grad():  # per_position works in float32; the gradient comes back in logits' dtype
                z = logits.detach().requires_grad_()
                loss = per_position(z, rows).sum()
                (grad_z,) = torch.autograd.grad(loss, z)
            total += loss.detach()
            if grad_hidden is not None:
                grad_hidden[rows] = (grad_z @ weight.to(grad_z.dtype)).to(hidden.dtype)
            if grad_weight is not None:
                grad_weight += (grad_z.t() @ h.to(grad_z.dtype)).float()
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.n, ctx.weight_dtype = max(n, 1), weight.dtype
        return total / max(n, 1)

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        grad_hidden, grad_weight = ctx.saved_tensors
        scale = grad_output / ctx.n
        return (
            grad_hidden * scale.to(grad_hidden.dtype) if grad_hidden is not None else None,
            (grad_weight * scale).to(ctx.weight_dtype) if grad_weight is not None else None,
            None,
            None,
        )
