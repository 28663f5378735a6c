"""Speculative decoding is lossless: greedy output is the target's, token for token."""

import random

import pytest
import torch

from draftsmith.serve.engine import Engine, EngineError
from draftsmith.serve.proposers import LookupFirst, PromptLookup, lookup, lookup_match, lookup_rows
from draftsmith.serve.sampling import RowSampling, SamplingParams
from draftsmith.serve.weights import load_model
from tests.conftest import FAMILIES, save_tiny_head

NUM_PROMPTS = 200
NEW_TOKENS = 12


def random_prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(1, 20))] for _ in range(n)]


def engines(target_dir, draft_dir, batch, overlap: bool = False):
    # float64: the check is of the algorithm, not of float rounding between 1-token and K+1-token forwards.
    # overlap: each step launched before the last one's tokens are read, as on a GPU
    target, draft = load_model(target_dir, torch.float64), load_model(draft_dir, torch.float64)
    return Engine(target, draft, max_batch_size=batch, max_seq_len=64, overlap=overlap)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_speculative_equals_target_greedy(tiny_models, family):
    target_dir, draft_dir = tiny_models[family]
    prompts = random_prompts(NUM_PROMPTS, 97, seed=FAMILIES.index(family))
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    one, wide = engines(target_dir, draft_dir, 1), engines(target_dir, draft_dir, 51, overlap=True)
    chunks = [prompts[i : i + 50] for i in range(0, NUM_PROMPTS, 50)]  # rows of different lengths, each accepting its own count
    expected = [c.tokens for chunk in chunks for c in wide.generate(chunk, params).completions]
    # one sampled row makes the whole step verify through the rejection sampler: greedy rows with one-hot
    # distributions, which must keep exactly the drafts that equal the target's argmax
    sampled = SamplingParams(temperature=1.0, max_new_tokens=NEW_TOKENS, seed=0)
    accepted = 0
    for k in range(1, 9):
        for i, chunk in enumerate(chunks):
            got = wide.generate(chunk, params, num_speculative_tokens=k)
            assert [c.tokens for c in got.completions] == expected[50 * i : 50 * i + 50], f"K={k}, prompts {50 * i}.."
            accepted += got.stats.num_accepted_tokens
            mixed = wide.generate(chunk + [chunk[0]], [params] * len(chunk) + [sampled], num_speculative_tokens=k)
            assert [c.tokens for c in mixed.completions[:-1]] == expected[50 * i : 50 * i + 50], f"K={k}, one-hot, prompts {50 * i}.."
        for i in range(k, NUM_PROMPTS, 25):  # batch 1: 8 prompts per K, other ones at each K
            got = one.generate([prompts[i]], params, num_speculative_tokens=k)
            assert got.completions[0].tokens == expected[i], f"K={k}, prompt {i}, batch 1"
    assert accepted > 0  # the draft agrees often enough that acceptance paths are exercised


def test_engines_sharing_models_run_in_turns_each_on_its_own_cache(tiny_models):
    # the evaluate stage times plain and speculative decoding in turns on two engines over one target: each
    # engine's setup allocates caches of its own sizes, and one made after another must not leave the other
    # running on its caches (on a GPU, graphs captured on freed caches gave tau 4.0 at K=3 where 2.16 is right)
    target_dir, draft_dir = tiny_models["llama"]
    target, draft = load_model(target_dir, torch.float64), load_model(draft_dir, torch.float64)
    prompts, params = random_prompts(6, 97, seed=11), SamplingParams(max_new_tokens=16)
    wide = Engine(target, None, max_batch_size=6, max_seq_len=64)
    expected = [c.tokens for c in wide.generate(prompts, params).completions]
    narrow = Engine(target, draft, max_batch_size=2, max_seq_len=40)  # smaller caches, set up since
    for _ in range(2):
        assert [c.tokens for c in wide.generate(prompts, params).completions] == expected
        got = [c.tokens for i in (0, 2, 4) for c in narrow.generate(prompts[i : i + 2], params, 3).completions]
        assert got == expected


def test_greedy_with_an_unrelated_draft(tiny_models):
    # a draft that almost never agrees exercises the rejection path at position 0
    target_dir, _ = tiny_models["llama"]
    other_target, _ = tiny_models["smollm2"]
    import pathlib
    import tempfile

    from tests.conftest import save_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        draft_dir = save_tiny_model(pathlib.Path(tmp) / "d", "llama", seed=99, num_layers=1)
        engine = engines(target_dir, draft_dir, 4)
        prompts = random_prompts(8, 97, seed=7)
        params = SamplingParams(max_new_tokens=16)
        expected = [c.tokens for c in engine.generate(prompts[:4], params).completions]
        got = engine.generate(prompts[:4], params, num_speculative_tokens=5)
        assert [c.tokens for c in got.completions] == expected
        assert got.stats.acceptance_rate < 0.5


def test_prompt_lookup_copies_the_latest_continuation_of_the_final_ngram():
    assert lookup([5, 6, 7, 9, 5, 6, 7, 8, 1, 5, 6, 7], k=3, max_ngram=3, min_ngram=1) == [8, 1, 5]
    assert lookup([1, 2, 3, 2], k=3, max_ngram=3, min_ngram=1) == [3, 2, 2]  # fewer follow: the last repeats
    assert lookup([1, 2, 3, 4], k=2, max_ngram=3, min_ngram=1) == [4, 4]  # no match
    assert lookup([7], k=2, max_ngram=3, min_ngram=1) == [7, 7]
    assert lookup([4, 4, 4, 4], k=2, max_ngram=2, min_ngram=2) == [4, 4]  # overlapping occurrences count
    assert lookup([1, 2, 9, 1, 2], k=2, max_ngram=3, min_ngram=2) == [9, 1]  # the 3-gram is not there, the 2-gram is


@pytest.mark.parametrize("seed", range(3))
def test_prompt_lookup_agrees_with_its_definition_on_random_texts(seed):
    # the definition, spelled out: every earlier n-gram that equals the final one, longest n first, the latest of them
    def defined(history, k, max_ngram, min_ngram):
        for n in range(min(max_ngram, len(history) - 1), min_ngram - 1, -1):
            starts = [i for i in range(len(history) - n) if history[i : i + n] == history[len(history) - n :]]
            if starts:
                follow = history[starts[-1] + n :][:k]
                return follow + follow[-1:] * (k - len(follow))
        return history[-1:] * k

    rng = random.Random(seed)
    for _ in range(300):
        vocab = rng.choice([3, 20, 5000])  # few distinct tokens: long matches; many: none
        history = [rng.randrange(vocab) for _ in range(rng.randrange(1, 300))]
        k, max_ngram = rng.randrange(1, 8), rng.randrange(1, 5)
        min_ngram = rng.randrange(1, max_ngram + 1)
        assert lookup(history, k, max_ngram, min_ngram) == defined(history, k, max_ngram, min_ngram)


@pytest.mark.parametrize("seed", range(3))
def test_the_devices_lookup_finds_what_the_hosts_does(seed):
    """lookup_rows searches every row's text at once (in a step's graph): the same drafts and the same n-gram
    lengths as lookup_match on each row's history, whatever the text holds past the history's end."""
    rng = random.Random(seed)
    for _ in range(40):
        vocab, width = rng.choice([3, 20, 5000]), rng.randrange(2, 120)
        histories = [[rng.randrange(vocab) for _ in range(rng.randrange(1, width))] for _ in range(rng.randrange(1, 6))]
        text = torch.tensor([h + [rng.randrange(vocab) for _ in range(width - len(h))] for h in histories])  # stale tokens after
        lengths = torch.tensor([len(h) - 1 for h in histories])  # the pending token is the history's last
        k, max_ngram = rng.randrange(1, 8), rng.randrange(1, 5)
        min_ngram = rng.randrange(1, max_ngram + 1)
        tokens, matched = lookup_rows(text, lengths, k, max_ngram, min_ngram)
        expected = [lookup_match(h, k, max_ngram, min_ngram) for h in histories]
        assert tokens.tolist() == [t for t, _ in expected] and matched.tolist() == [n for _, n in expected]


def test_the_states_text_is_each_rows_prompt_and_output(tiny_models):
    """DecodeState.text, what prompt lookup searches, holds each row's prompt and every token it emitted, after
    steps that kept different numbers of drafts in different rows, and stays put in a finished row."""
    target_dir, draft_dir = tiny_models["qwen2"]
    engine = engines(target_dir, draft_dir, 3)
    prompts = [[i % 5 + 1 for i in range(14)], [3, 9, 4, 3, 9], [7] * 9]
    rows = RowSampling.of([SamplingParams()] * 3, engine.device)
    state, _ = engine.prefill(prompts, rows, None)
    texts = [list(p) + [t] for p, t in zip(prompts, state.pending.tolist())]
    active, kept = torch.ones(3, dtype=torch.bool), []
    with torch.inference_mode():  # as the engine steps
        for step in range(8):
            if step == 5:
                active[1] = False
            out = engine.step(state, active, 3, rows, None, PromptLookup(97))
            for i, (n, tokens) in enumerate(zip(out.num_accepted.tolist(), out.tokens.tolist())):
                texts[i] += tokens[: n + 1] if active[i] else []
                kept += [n] if active[i] else []
    assert state.lengths.tolist() == [len(t) - 1 for t in texts]
    assert [state.text[i, : len(t)].tolist() for i, t in enumerate(texts)] == texts
    assert 0 < sum(kept) and 0 in kept  # rows kept different numbers of drafts


def test_greedy_prompt_lookup_equals_target_greedy(tiny_models):
    target_dir, draft_dir = tiny_models["qwen2"]
    engine = engines(target_dir, draft_dir, 4)
    # repetitive prompts, so that lookups hit and acceptance paths run
    prompts = [[i % 5 + j for i in range(14)] for j in range(8)]
    params = SamplingParams(max_new_tokens=16)
    expected = [c.tokens for p in (prompts[:4], prompts[4:]) for c in engine.generate(p, params).completions]
    for k in (1, 3, 6):
        runs = [engine.generate(p, params, k, proposer=PromptLookup(97)) for p in (prompts[:4], prompts[4:])]
        assert [c.tokens for run in runs for c in run.completions] == expected, f"K={k}"
        assert sum(run.stats.num_accepted_tokens for run in runs) > 0


class Recorded(LookupFirst):
    """LookupFirst noting, per step, which rows took the lookup's drafts and how many drafts each row kept."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.steps: list[tuple[list[bool], list[int]]] = []

    def propose(self, state, k, rows, generator, histories=()):
        use = (lookup_rows(state.text, state.lengths, k, self.max_ngram, 1)[1] >= self.min_match).tolist()
        if not self.on_device:  # the host's choice is the device's in every row still running (a finished one's
            # text on the device holds the tokens of its last step past its end)
            running = [len(h) == n + 1 for h, n in zip(histories, state.lengths.tolist())]
            assert [u for u, r in zip(self.plan(histories, k)[1], running) if r] == [u for u, r in zip(use, running) if r]
        self.steps.append((use, []))
        return super().propose(state, k, rows, generator, histories)

    def follow(self, state, out):
        if out.tokens.shape[1] > 1:
            self.steps[-1][1].extend(out.num_accepted.tolist())
        return super().follow(state, out)


def test_lookup_first_says_how_long_a_match_it_found():
    assert lookup_match([5, 6, 7, 9, 5, 6, 7, 8, 1, 5, 6, 7], 3, 3, 1) == ([8, 1, 5], 3)
    assert lookup_match([1, 2, 9, 1, 2], 2, 3, 1) == ([9, 1], 2)
    assert lookup_match([1, 2, 3, 4], 2, 3, 1) == ([4, 4], 0)
    with pytest.raises(ValueError, match="min_match"):
        LookupFirst(None, 97, min_match=4, max_ngram=3)


@pytest.mark.parametrize("kind", ["draft model", "eagle3"])
def test_greedy_lookup_first_equals_target_greedy(tiny_models, kind, tmp_path):
    """Rows that repeat themselves take the lookup's drafts, the others the draft's; on the host some steps have
    no draft forward at all. Output is the target's, and on the device (the search in the step) the host's, with
    the same acceptance."""
    target_dir, draft_dir = tiny_models["gemma2"]  # whose greedy text soon falls into loops: long matches
    target = load_model(target_dir, torch.float64)
    if kind == "eagle3":
        from draftsmith.serve.eagle import load_head

        draft = load_head(save_tiny_head(target_dir, tmp_path / "head", seed=2), torch.float64)
    else:
        draft = load_model(draft_dir, torch.float64)
    engine = Engine(target, draft, max_batch_size=4, max_seq_len=96)
    repeating = [[i % 4 + j for i in range(12)] for j in range(4)]
    prompts = repeating[:2] + random_prompts(2, 97, seed=3) + repeating[2:] + random_prompts(2, 97, seed=4)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    expected = [c.tokens for i in (0, 4) for c in engine.generate(prompts[i : i + 4], params).completions]
    for k, batch in ((1, 4), (3, 4), (5, 4), (3, 1)):
        stats = []
        for on_device in (False, True):
            proposer = Recorded(engine.draft_proposer, 97, min_match=3, on_device=on_device)
            runs = [engine.generate(prompts[i : i + batch], params, k, proposer=proposer) for i in range(0, len(prompts), batch)]
            assert [c.tokens for run in runs for c in run.completions] == expected, f"K={k}, batch {batch}, on the device: {on_device}"
            took = [t for step, _ in proposer.steps for t in step]
            assert any(took) and not all(took), f"K={k}: both proposers drafted"
            assert any(all(step) for step, _ in proposer.steps), f"K={k}: some step's rows all took the lookup's drafts"
            stats.append([run.stats.as_dict() for run in runs])
        assert stats[0] == stats[1], f"K={k}, batch {batch}"


@pytest.mark.parametrize("on_device", [False, True])
@pytest.mark.parametrize("k", [3, 5])
def test_a_draft_model_reads_what_the_lookup_drafted(tiny_models, k, on_device):
    """With the target as its own draft model, a row the draft model drafts keeps all K drafts, also after
    steps whose drafts came from the lookup: its cache holds every token the target read."""
    target_dir, _ = tiny_models["qwen2"]
    engine = Engine(load_model(target_dir, torch.float64), load_model(target_dir, torch.float64), max_batch_size=4, max_seq_len=96)
    prompts = [[i % 4 + j for i in range(12)] for j in range(2)] + random_prompts(2, 97, seed=3)
    proposer = Recorded(engine.draft_proposer, 97, min_match=1, on_device=on_device)
    engine.generate(prompts, SamplingParams(max_new_tokens=24, ignore_eos=True), k, proposer=proposer)
    after_lookup, looked = [], [False] * len(prompts)
    for step, kept in proposer.steps:
        for row, (lookup_row, n) in enumerate(zip(step, kept)):
            if not lookup_row and looked[row]:
                after_lookup.append(n)
            looked[row] |= lookup_row
    assert len(after_lookup) >= 5 and all(n == k for n in after_lookup), after_lookup


@pytest.mark.parametrize("overlap", [False, True])
def test_spec_stats_count_tau_and_acceptance(tiny_models, overlap):
    target_dir, _ = tiny_models["llama"]
    engine = engines(target_dir, target_dir, 1, overlap)  # the target as its own draft accepts everything
    streamed = []
    got = engine.generate(
        [[1, 2, 3]],
        SamplingParams(max_new_tokens=1 + 3 * 5),
        num_speculative_tokens=4,
        on_tokens=lambda row, tokens: streamed.append(len(tokens)),
    )
    assert got.stats.acceptance_rate == 1.0
    assert got.stats.tau == 5.0
    assert got.target_steps == 3  # with overlap a fourth step was launched before the third's tokens were read: not counted
    assert got.stats.acceptance_by_position == [1.0] * 4
    assert streamed == [1, 5, 5, 5]


@pytest.mark.parametrize("overlap", [False, True])
def test_stops(tiny_models, overlap):
    target_dir, draft_dir = tiny_models["qwen2"]
    engine = engines(target_dir, draft_dir, 1, overlap)
    prompt = [5, 6, 7]
    free = engine.generate([prompt], SamplingParams(max_new_tokens=20)).completions[0].tokens
    stop_at = free[6]
    cut = free.index(stop_at)
    for k in (0, 3):
        ended = engine.generate([prompt], SamplingParams(max_new_tokens=20, stop_token_ids=(stop_at,)), k).completions[0]
        assert ended.tokens == free[:cut] and ended.finish_reason == "stop"
        engine.eos_token_ids = frozenset({stop_at})
        assert engine.generate([prompt], SamplingParams(max_new_tokens=20), k).completions[0].tokens == free[:cut]
        ignoring = engine.generate([prompt], SamplingParams(max_new_tokens=20, ignore_eos=True), k).completions[0]
        assert ignoring.tokens == free and ignoring.finish_reason == "length"
        engine.eos_token_ids = frozenset()
    # stop strings: detokenize as space-separated ids; stop at the text of the 4th token
    engine.detokenize = lambda ids: " ".join(f"<{i}>" for i in ids)
    ended = engine.generate([prompt], SamplingParams(max_new_tokens=20, stop=(f"<{free[3]}>",)), 3).completions[0]
    first = free.index(free[3])
    assert ended.tokens == free[: first + 1] and ended.finish_reason == "stop"
    assert ended.text == " ".join(f"<{i}>" for i in free[:first]) + " "


@pytest.mark.parametrize("k", [0, 3])
def test_logprobs_are_the_targets(tiny_models, k):
    target_dir, draft_dir = tiny_models["mistral"]
    engine = engines(target_dir, draft_dir, 1)
    params = SamplingParams(max_new_tokens=6, logprobs=True, top_logprobs=4)
    got = engine.generate([[3, 4]], params, num_speculative_tokens=k).completions[0]
    model = load_model(target_dir, torch.float64)
    model.setup_cache(1, 64)
    sequence = [3, 4] + got.tokens
    with torch.no_grad():
        logits = model(torch.tensor([sequence]), torch.arange(len(sequence))[None])[0].log_softmax(-1)
    expected = [logits[1 + i, t].item() for i, t in enumerate(got.tokens)]
    assert got.logprobs.tokens == pytest.approx(expected, abs=1e-5)
    for i, (ids, values) in enumerate(got.logprobs.top_tokens):
        top = logits[1 + i].topk(4)
        assert ids == top.indices.tolist() and values == pytest.approx(top.values.tolist(), abs=1e-5)


def test_requests_that_do_not_fit_are_refused(tiny_models):
    target_dir, draft_dir = tiny_models["llama"]
    engine = engines(target_dir, draft_dir, 1)
    with pytest.raises(EngineError, match="exceed max_seq_len"):
        engine.generate([[1] * 40], SamplingParams(max_new_tokens=30), num_speculative_tokens=2)
    with pytest.raises(EngineError, match="max_batch_size"):
        engine.generate([[1], [2]], SamplingParams())
    with pytest.raises(EngineError, match="outside the vocabulary"):
        engine.generate([[1000]], SamplingParams())


def test_a_forward_outside_inference_mode_keeps_no_autograd_graph_in_the_cache(tiny_models):
    # a warm-up that forgot inference mode made the KV cache part of an autograd graph: every forward's
    # activations stayed alive behind it (134 GiB on an H200)
    target_dir, draft_dir = tiny_models["llama"]
    engine = engines(target_dir, draft_dir, 2)
    tokens = torch.tensor([[1, 2, 3], [4, 5, 6]])
    engine.target(tokens, torch.arange(3).expand(2, 3))
    engine.draft(tokens, torch.arange(3).expand(2, 3))
    caches = [a.cache for model in (engine.target, engine.draft) for a in model.attention_layers()]
    assert all(c.k.grad_fn is None and c.v.grad_fn is None and not c.k.requires_grad for c in caches)


def test_draft_with_another_vocab_is_refused(tiny_models, tmp_path):
    from tests.conftest import save_tiny_model

    target_dir, _ = tiny_models["llama"]
    draft_dir = save_tiny_model(tmp_path / "d", "llama", seed=1, vocab_size=99)
    with pytest.raises(EngineError, match="draft vocab size 99 != target 97"):
        Engine(load_model(target_dir), load_model(draft_dir))


def test_greedy_rows_stay_exact_in_a_batch_with_sampled_rows(tiny_models):
    # mixed batches verify greedy rows through the rejection sampler with one-hot distributions
    target_dir, draft_dir = tiny_models["smollm2"]
    engine = engines(target_dir, draft_dir, 4)
    prompts = random_prompts(4, 97, seed=3)
    greedy, sampled = SamplingParams(max_new_tokens=16, seed=0), SamplingParams(temperature=1.0, max_new_tokens=16, seed=0)
    expected = [c.tokens for c in engine.generate(prompts, greedy).completions]
    for k in (1, 4):
        got = engine.generate(prompts, [greedy, sampled, greedy, sampled], num_speculative_tokens=k)
        assert got.completions[0].tokens == expected[0] and got.completions[2].tokens == expected[2]
