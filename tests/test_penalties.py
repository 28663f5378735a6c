"""Penalties and logit bias (serve/penalties.py) as vLLM defines them: greedy speculative output equals plain
greedy output with the same penalties, for a draft model, an EAGLE-3 head and prompt lookup, in batches mixing
penalised and plain rows, through the engine and the continuous-batching scheduler; sampled speculative output
follows the penalised target distribution (chi-square against a distribution computed from the definitions,
with a control that the test tells penalties from none)."""

import numpy as np
import pytest
import torch

from draftsmith.serve.engine import Engine, EngineError
from draftsmith.serve.proposers import PromptLookup
from draftsmith.serve.sampling import SamplingError, SamplingParams
from draftsmith.serve.scheduler import Request, Scheduler
from draftsmith.serve.weights import load_model
from tests.conftest import save_tiny_head
from tests.test_sampling import PROMPT, SAMPLES, VOCAB, chi_square_p, small_vocab_models  # noqa: F401
from tests.test_speculative import random_prompts

PENALTIES = [
    dict(repetition_penalty=1.3),
    dict(frequency_penalty=0.8, presence_penalty=0.5),
    dict(presence_penalty=-1.0, logit_bias=((5, 4.0), (9, -3.0))),
    dict(repetition_penalty=0.8, frequency_penalty=-0.5, logit_bias=((1, 2.0),)),
]


def greedy_runs(engine: Engine, prompts, params, k: int, proposer=None) -> list[list[int]]:
    return [c.tokens for c in engine.generate(prompts, params, num_speculative_tokens=k, proposer=proposer).completions]


@pytest.mark.parametrize("settings", PENALTIES)
def test_greedy_speculative_equals_plain_greedy_with_the_same_penalties(tiny_models, tmp_path, settings):
    target_dir, draft_dir = tiny_models["llama"]
    target = load_model(target_dir, torch.float64)
    head = load_model_head(target_dir, tmp_path)
    prompts = random_prompts(24, 97, seed=3)
    penalised = [
        SamplingParams(max_new_tokens=16, **settings) if i % 3 else SamplingParams(max_new_tokens=16) for i in range(len(prompts))
    ]  # a third of the rows without penalties: mixed batches
    plain = Engine(target, None, max_batch_size=24, max_seq_len=64)
    expected = greedy_runs(plain, prompts, penalised, 0)
    unpenalised = greedy_runs(plain, prompts, SamplingParams(max_new_tokens=16), 0)
    assert sum(a != b for a, b in zip(expected, unpenalised)) >= 8  # the penalties do change the greedy text
    for draft in (load_model(draft_dir, torch.float64), head, None):
        engine = Engine(target, draft, max_batch_size=24, max_seq_len=64)
        for k in (1, 3, 5):
            proposer = PromptLookup(97) if draft is None else None
            assert greedy_runs(engine, prompts, penalised, k, proposer) == expected, (type(draft).__name__, k)


def load_model_head(target_dir, tmp_path):
    from draftsmith.serve.eagle import load_head

    return load_head(save_tiny_head(target_dir, tmp_path / "head", seed=5), torch.float64, "cpu")


def test_the_scheduler_keeps_each_rows_penalties_as_requests_come_and_go(tiny_models):
    # rows are reused: a request joining a row must not inherit the counts of the one that left it
    target_dir, draft_dir = tiny_models["llama"]
    target, draft = load_model(target_dir, torch.float64), load_model(draft_dir, torch.float64)
    prompts = random_prompts(12, 97, seed=8)
    params = [
        SamplingParams(max_new_tokens=8 + i, **PENALTIES[i % 4]) if i % 2 else SamplingParams(max_new_tokens=8 + i)
        for i in range(len(prompts))
    ]
    expected = greedy_runs(Engine(target, None, max_batch_size=12, max_seq_len=64), prompts, params, 0)
    scheduler = Scheduler(Engine(target, draft, max_batch_size=4, max_seq_len=64), 3, adaptive=False)
    done = {}
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        scheduler.submit(Request(prompt, p, on_done=lambda result, i=i: done.__setitem__(i, result)))
    scheduler.drain()
    assert [done[i].tokens for i in range(len(prompts))] == expected


def test_a_large_logit_bias_forces_its_token(tiny_models):
    target_dir, _ = tiny_models["llama"]
    engine = Engine(load_model(target_dir, torch.float64), None, max_batch_size=2, max_seq_len=40)
    for temperature in (0.0, 1.0):
        params = SamplingParams(temperature=temperature, seed=1, max_new_tokens=10, logit_bias=((42, 100.0),))
        assert engine.generate([[1, 2, 3], [4, 5]], params).completions[0].tokens == [42] * 10


def test_penalties_out_of_range_and_bias_outside_the_vocabulary_are_refused(tiny_models):
    for bad, name in (
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=-3), "frequency_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(logit_bias=((3, 150.0),)), "logit_bias"),
    ):
        with pytest.raises(SamplingError, match=name):
            SamplingParams(**bad)
    engine = Engine(load_model(tiny_models["llama"][0], torch.float64), None, max_batch_size=1, max_seq_len=40)
    with pytest.raises(EngineError, match="logit_bias names token ids outside the vocabulary"):
        engine.generate([[1, 2]], SamplingParams(logit_bias=((97, 1.0),)))


def penalised_reference(logits: np.ndarray, prompt: list[int], output: list[int], s: dict) -> np.ndarray:
    """vLLM's definitions, written directly: logit bias, then repetition over prompt and output tokens,
    then frequency and presence over output tokens."""
    z = logits.astype(np.float64).copy()
    for token, bias in s.get("logit_bias", ()):
        z[token] += bias
    counts = np.bincount(output, minlength=len(z)).astype(np.float64)
    seen = counts > 0
    seen[prompt] = True
    r = s.get("repetition_penalty", 1.0)
    z = np.where(seen, np.where(z > 0, z / r, z * r), z)
    return z - s.get("frequency_penalty", 0.0) * counts - s.get("presence_penalty", 0.0) * (counts > 0)


def penalised_joint(target_dir, settings: dict, temperature: float) -> np.ndarray:
    """P(t1, t2, t3) of the target with penalties and bias: [V, V, V]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float64).eval()
    grid = torch.cartesian_prod(torch.arange(VOCAB), torch.arange(VOCAB))
    with torch.no_grad():
        logits = model(torch.cat([torch.tensor(PROMPT).expand(len(grid), -1), grid], dim=1)).logits.numpy()
    n = len(PROMPT)
    softmax = lambda z: np.exp(z / temperature - (z / temperature).max()) / np.exp(z / temperature - (z / temperature).max()).sum()
    joint = np.zeros((VOCAB,) * 3)
    p1 = softmax(penalised_reference(logits[0, n - 1], PROMPT, [], settings))
    for t1 in range(VOCAB):
        p2 = softmax(penalised_reference(logits[t1 * VOCAB, n], PROMPT, [t1], settings))
        for t2 in range(VOCAB):
            p3 = softmax(penalised_reference(logits[t1 * VOCAB + t2, n + 1], PROMPT, [t1, t2], settings))
            joint[t1, t2] = p1[t1] * p2[t2] * p3
    return joint


@pytest.mark.parametrize("k", [1, 2])
def test_speculative_sampling_follows_the_penalised_target_distribution(small_vocab_models, k):  # noqa: F811
    target_dir, draft_dir = small_vocab_models
    settings = dict(repetition_penalty=1.6, frequency_penalty=0.7, presence_penalty=0.4, logit_bias=((2, 1.5), (6, -1.0)))
    joint = penalised_joint(target_dir, settings, temperature=1.0)
    engine = Engine(load_model(target_dir, torch.float64), load_model(draft_dir, torch.float64), max_batch_size=SAMPLES, max_seq_len=12)
    got = engine.generate([PROMPT] * SAMPLES, SamplingParams(temperature=1.0, seed=77, max_new_tokens=3, **settings), k)
    tokens = np.array([c.tokens[:3] for c in got.completions])
    assert 0.05 < got.stats.acceptance_rate < 0.95  # acceptance and rejection both exercised
    first_two = chi_square_p(tokens[:, 0] * VOCAB + tokens[:, 1], joint.sum(2))
    second_third = chi_square_p(tokens[:, 1] * VOCAB + tokens[:, 2], joint.sum(0))
    assert first_two > 1e-3 and second_third > 1e-3, (first_two, second_third)
    # the control: against the distribution without penalties the same samples fail
    unpenalised = penalised_joint(target_dir, {}, temperature=1.0)
    assert chi_square_p(tokens[:, 1] * VOCAB + tokens[:, 2], unpenalised.sum(0) + 1e-12) < 1e-6
