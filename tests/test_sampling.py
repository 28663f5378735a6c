"""Speculative sampling follows the target's distribution: a chi-square test on 20,000 samples of the
first generated tokens, against the exact distribution computed from transformers' logits, and a
deliberately wrong verifier that the same test must catch."""

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from draftsmith.serve.engine import Engine
from draftsmith.serve.proposers import LookupFirst, PromptLookup, lookup_rows
from draftsmith.serve.rejection import append_correction
from draftsmith.serve.sampling import RowSampling, SamplingError, SamplingParams, probabilities, sample
from draftsmith.serve.weights import load_model
from tests.conftest import save_tiny_model

VOCAB = 12
SAMPLES = 20_000
PROMPT = [3, 7, 1]


@pytest.fixture(scope="module")
def small_vocab_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("small-vocab")
    target = save_tiny_model(root / "target", "llama", seed=11, vocab_size=VOCAB)
    draft = save_tiny_model(root / "draft", "llama", seed=12, vocab_size=VOCAB, num_layers=1)
    return target, draft


def reference_probs(logits: np.ndarray, temperature: float, top_p: float, min_p: float = 0.0) -> np.ndarray:
    """Temperature, then min-p, then nucleus filtering, written directly from the definitions."""
    z = logits / temperature
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    if min_p > 0:
        p = np.where(p >= min_p * p.max(-1, keepdims=True), p, 0.0)
        p /= p.sum(-1, keepdims=True)
    if top_p < 1:
        out = np.zeros_like(p)
        for row in range(p.shape[0]):
            order = np.argsort(-p[row], kind="stable")
            mass_before = np.cumsum(p[row, order]) - p[row, order]
            keep = order[mass_before < top_p]
            out[row, keep] = p[row, keep] / p[row, keep].sum()
        p = out
    return p


def exact_joint(target_dir, temperature: float, top_p: float, min_p: float = 0.0) -> np.ndarray:
    """P(t1, t2, t3) for the target: [V, V, V]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float64).eval()
    grid = torch.cartesian_prod(torch.arange(VOCAB), torch.arange(VOCAB))  # [V*V, 2]
    sequences = torch.cat([torch.tensor(PROMPT).expand(len(grid), -1), grid], dim=1)
    with torch.no_grad():
        logits = model(sequences).logits.numpy()
    n = len(PROMPT)
    p1 = reference_probs(logits[:1, n - 1], temperature, top_p, min_p)[0]  # [V]
    p2 = reference_probs(logits[::VOCAB, n], temperature, top_p, min_p)  # [V(t1), V]
    p3 = reference_probs(logits[:, n + 1], temperature, top_p, min_p).reshape(VOCAB, VOCAB, VOCAB)
    return p1[:, None, None] * p2[:, :, None] * p3


def chi_square_p(samples: np.ndarray, probs: np.ndarray) -> float:
    observed = np.bincount(samples, minlength=probs.size).astype(float)
    expected = probs.ravel() * len(samples)
    assert observed[expected == 0].sum() == 0, "a token outside the target's support was sampled"
    big = expected >= 5  # cells with small expectations pooled into one
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


def speculative_samples(target_dir, draft_dir, params: SamplingParams, verify=None, proposer=None, vocab=None, k: int = 2):
    """The first 3 tokens of SAMPLES generations. With K = 2, tokens 2 and 3 are drafts or corrections;
    with K = 1, token 3 is the bonus whenever the draft was accepted."""
    draft = load_model(draft_dir, torch.float64)
    if vocab is not None:
        draft.use_vocab(vocab)
    engine = Engine(
        load_model(target_dir, torch.float64), draft, max_batch_size=SAMPLES, max_seq_len=12, **({"verify": verify} if verify else {})
    )
    got = engine.generate([PROMPT] * SAMPLES, params, num_speculative_tokens=k, proposer=proposer)
    return np.array([c.tokens[:3] for c in got.completions]), got.stats


def bonus_from_the_draft(draft_tokens, draft_probs, target_probs, generator):
    """Wrong on purpose: the right ratio test and residual, but a bonus drawn from the draft's last
    distribution instead of the target's next one."""
    from draftsmith.serve.rejection import rejection_sample

    num_accepted, tokens = rejection_sample(draft_tokens, draft_probs, target_probs, generator)
    K = draft_tokens.shape[1]
    wrong = sample(draft_probs[:, -1], generator)
    return num_accepted, torch.where(num_accepted.unsqueeze(1) == K, torch.cat([draft_tokens, wrong.unsqueeze(1)], 1), tokens)


def accept_only_equal_samples(draft_tokens, draft_probs, target_probs, generator):
    """Wrong on purpose: keep a draft token only if it equals a sample of the target, then correct
    from the residual as if the ratio test had rejected it."""
    K = draft_tokens.shape[1]
    num_accepted = (sample(target_probs[:, :K], generator) == draft_tokens).int().cumprod(1).sum(1)
    return num_accepted, append_correction(num_accepted, draft_tokens, draft_probs, target_probs, generator)


SETTINGS = [(0.7, 1.0), (1.0, 1.0), (1.0, 0.9)]


@pytest.mark.parametrize("temperature,top_p,min_p,k", [(t, p, 0.0, 2) for t, p in SETTINGS] + [(1.0, 1.0, 0.0, 1), (1.0, 1.0, 0.3, 2)])
def test_speculative_sampling_matches_target_distribution(small_vocab_models, temperature, top_p, min_p, k):
    target_dir, draft_dir = small_vocab_models
    joint = exact_joint(target_dir, temperature, top_p, min_p)
    if min_p:  # the cut removes part of the support (the test checks nothing is sampled there)
        assert (joint == 0).any()
    params = SamplingParams(temperature=temperature, top_p=top_p, min_p=min_p, seed=1234, max_new_tokens=3)
    tokens, stats = speculative_samples(target_dir, draft_dir, params, k=k)
    assert 0.05 < stats.acceptance_rate < 0.95  # both acceptance and rejection are exercised
    first_two = chi_square_p(tokens[:, 0] * VOCAB + tokens[:, 1], joint.sum(2))
    # tokens 2 and 3 both come from one speculative step: accepted drafts, corrections and (K = 1) bonuses
    second_third = chi_square_p(tokens[:, 1] * VOCAB + tokens[:, 2], joint.sum(0))
    assert first_two > 1e-3 and second_third > 1e-3, (first_two, second_third)


def test_prompt_lookup_sampling_matches_target_distribution(small_vocab_models):
    # deterministic proposals are one-hot q: kept with probability p(token), else redrawn from the residual
    target_dir, draft_dir = small_vocab_models
    joint = exact_joint(target_dir, 1.0, 1.0)
    params = SamplingParams(temperature=1.0, seed=99, max_new_tokens=3)
    tokens, stats = speculative_samples(target_dir, draft_dir, params, proposer=PromptLookup(VOCAB))
    assert 0.02 < stats.acceptance_rate < 0.98
    second_third = chi_square_p(tokens[:, 1] * VOCAB + tokens[:, 2], joint.sum(0))
    assert second_third > 1e-3, second_third


@pytest.mark.parametrize("on_device", [False, True])
def test_lookup_first_sampling_matches_target_distribution(small_vocab_models, on_device):
    # in one step some rows verify the lookup's one-hot q, the others the draft model's q
    target_dir, draft_dir = small_vocab_models
    joint = exact_joint(target_dir, 1.0, 1.0)
    params = SamplingParams(temperature=1.0, seed=7, max_new_tokens=3)
    seen = []

    class Noted(LookupFirst):
        def propose(self, state, k, rows, generator, histories=()):
            seen.append(int((lookup_rows(state.text, state.lengths, k, self.max_ngram, 1)[1] >= self.min_match).sum()))
            return super().propose(state, k, rows, generator, histories)

    draft = load_model(draft_dir, torch.float64)
    engine = Engine(load_model(target_dir, torch.float64), draft, max_batch_size=SAMPLES, max_seq_len=12)
    proposer = Noted(engine.draft_proposer, VOCAB, min_match=1, on_device=on_device)
    got = engine.generate([PROMPT] * SAMPLES, params, num_speculative_tokens=2, proposer=proposer)
    tokens = np.array([c.tokens[:3] for c in got.completions])
    assert 0 < seen[0] < SAMPLES  # the first speculative step mixed the two proposers
    assert 0.02 < got.stats.acceptance_rate < 0.98
    second_third = chi_square_p(tokens[:, 1] * VOCAB + tokens[:, 2], joint.sum(0))
    assert second_third > 1e-3, second_third


@pytest.mark.parametrize(
    "temperature,top_p,verify,k", [(t, p, accept_only_equal_samples, 2) for t, p in SETTINGS[1:]] + [(1.0, 1.0, bonus_from_the_draft, 1)]
)
def test_the_distribution_test_catches_a_wrong_verifier(small_vocab_models, temperature, top_p, verify, k):
    target_dir, draft_dir = small_vocab_models
    joint = exact_joint(target_dir, temperature, top_p)
    params = SamplingParams(temperature=temperature, top_p=top_p, seed=1234, max_new_tokens=3)
    tokens, _ = speculative_samples(target_dir, draft_dir, params, verify=verify, k=k)
    second_third = chi_square_p(tokens[:, 1] * VOCAB + tokens[:, 2], joint.sum(0))
    assert second_third < 1e-6


def test_same_seed_same_samples(small_vocab_models):
    target_dir, draft_dir = small_vocab_models
    engine = Engine(load_model(target_dir, torch.float64), load_model(draft_dir, torch.float64), max_batch_size=4, max_seq_len=40)
    params = SamplingParams(temperature=1.0, seed=5, max_new_tokens=20)
    runs = [[c.tokens for c in engine.generate([PROMPT] * 4, params, 3).completions] for _ in range(2)]
    assert runs[0] == runs[1]
    assert len({tuple(t) for t in runs[0]}) > 1  # rows draw independently


def test_top_k_keeps_the_k_most_likely():
    logits = torch.tensor([[[0.0, 3.0, 1.0, 2.0, -1.0]]])
    rows = RowSampling.of([SamplingParams(temperature=1.0, top_k=2)], torch.device("cpu"))
    probs = probabilities(logits, rows)[0, 0]
    assert (probs > 0).tolist() == [False, True, False, True, False]
    assert probs.sum().item() == pytest.approx(1.0)


@pytest.mark.parametrize(
    "bad", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-2), dict(min_p=1.5), dict(max_new_tokens=0)]
)
def test_bad_sampling_parameters_are_refused(bad):
    with pytest.raises(SamplingError, match=next(iter(bad))):
        SamplingParams(**bad)


def test_greedy_is_argmax_with_the_first_of_equal_maxima():
    # on a CPU greedy tokens come from max(), which must break ties as argmax does (few distinct values: many ties)
    from draftsmith.serve.sampling import greedy

    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        logits = torch.randint(0, 3, (8, 3, 500)).to(dtype)
        assert torch.equal(greedy(logits), logits.argmax(-1))


def test_speculative_sampling_matches_the_target_within_a_sliding_window(tmp_path):
    # a window of 2: the third generated token is drawn after a sequence longer than the window, so the
    # kernel's window (in the cache, the verification and the draft) decides what the target's distribution is
    from transformers import MistralConfig

    from tests.conftest import tiny_config

    configs = {
        name: MistralConfig(**{**tiny_config("mistral", vocab_size=VOCAB).to_dict(), "sliding_window": 2, "num_hidden_layers": layers})
        for name, layers in (("target", 3), ("draft", 1))
    }
    dirs = {}
    for seed, (name, config) in enumerate(configs.items()):
        from transformers import AutoModelForCausalLM

        torch.manual_seed(20 + seed)
        model = AutoModelForCausalLM.from_config(config)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2:
                    p.normal_(0, 0.15)
        model.save_pretrained(tmp_path / name)
        dirs[name] = tmp_path / name
    joint = exact_joint(dirs["target"], 1.0, 1.0)
    params = SamplingParams(temperature=1.0, seed=321, max_new_tokens=3)
    tokens, stats = speculative_samples(dirs["target"], dirs["draft"], params, k=2)
    assert 0.05 < stats.acceptance_rate < 0.95
    assert chi_square_p(tokens[:, 1] * VOCAB + tokens[:, 2], joint.sum(0)) > 1e-3
