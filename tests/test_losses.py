"""Distillation losses against direct computations, and the top-k cache's tail handling."""

import math

import numpy as np
import pytest
import torch

from draftsmith.distill import losses


def direct(name, p, q, beta=0.5):
    if name == "forward_kl":
        return sum(pi * math.log(pi / qi) for pi, qi in zip(p, q) if pi > 0)
    if name == "reverse_kl":
        return sum(qi * math.log(qi / pi) for pi, qi in zip(p, q) if qi > 0)
    if name == "tvd":
        return 0.5 * sum(abs(pi - qi) for pi, qi in zip(p, q))
    m = [beta * pi + (1 - beta) * qi for pi, qi in zip(p, q)]
    return beta * direct("forward_kl", p, m) + (1 - beta) * direct("forward_kl", q, m)


@pytest.mark.parametrize("name", ["forward_kl", "reverse_kl", "jsd", "tvd"])
@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_divergences_match_direct_computation(name, temperature):
    rng = np.random.default_rng(0)
    target_logits, student_logits = torch.tensor(rng.normal(size=(5, 11)) * 2), torch.tensor(rng.normal(size=(5, 11)) * 2)
    logp, logq = losses.full(student_logits, target_logits, temperature)
    got = losses.divergence(name, logp, logq, beta=0.3)
    for row in range(5):
        p = torch.softmax(target_logits[row] / temperature, -1).tolist()
        q = torch.softmax(student_logits[row] / temperature, -1).tolist()
        assert got[row].item() == pytest.approx(direct(name, p, q, beta=0.3), rel=1e-5, abs=1e-7)


def test_divergences_vanish_for_equal_distributions():
    logits = torch.randn(3, 7)
    logp, logq = losses.full(logits, logits, 1.0)
    for name in ("forward_kl", "reverse_kl", "jsd", "tvd"):
        assert losses.divergence(name, logp, logq).abs().max().item() < 1e-6


def test_top_k_cache_with_tail_equals_bucketed_full_distributions():
    rng = np.random.default_rng(1)
    target_logits, student_logits = torch.tensor(rng.normal(size=(4, 30)) * 3), torch.tensor(rng.normal(size=(4, 30)) * 3)
    k = 5
    target_lp = torch.log_softmax(target_logits, -1)
    topk_lp, topk_ids = target_lp.topk(k, -1)
    logp, logq = losses.bucketed(student_logits, topk_ids, topk_lp, temperature=1.0)
    assert logp.exp().sum(-1).tolist() == pytest.approx([1.0] * 4) and logq.exp().sum(-1).tolist() == pytest.approx([1.0] * 4)
    for row in range(4):
        p_full = target_lp[row].exp()
        q_full = torch.softmax(student_logits[row], -1)
        ids = topk_ids[row]
        rest = torch.ones(30, dtype=torch.bool)
        rest[ids] = False
        p = p_full[ids].tolist() + [p_full[rest].sum().item()]
        q = q_full[ids].tolist() + [q_full[rest].sum().item()]
        assert logp[row].exp().tolist() == pytest.approx(p, rel=1e-5)
        assert logq[row].exp().tolist() == pytest.approx(q, rel=1e-5)
        # bucketing only merges outcomes, so the bucketed TVD never exceeds the full one
        full_tvd = losses.tvd(*losses.full(student_logits[row : row + 1], target_logits[row : row + 1], 1.0)).item()
        assert losses.tvd(logp[row : row + 1], logq[row : row + 1]).item() <= full_tvd + 1e-7


def test_hard_label_is_cross_entropy_on_teacher_tokens():
    logits = torch.tensor([[2.0, 0.0, -1.0], [0.0, 0.0, 0.0]])
    got = losses.hard_label(logits, torch.tensor([0, 2]))
    assert got[0].item() == pytest.approx(-math.log(math.exp(2) / (math.exp(2) + 1 + math.exp(-1))))
    assert got[1].item() == pytest.approx(math.log(3))
