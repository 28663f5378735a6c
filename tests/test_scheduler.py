"""Continuous batching stays lossless: requests that join and leave the running batch between steps get
the target's greedy output token for token and its sampling distribution; adaptive K follows the
cost model; a cancelled request frees its row."""

import multiprocessing
import threading

import numpy as np
import pytest
import torch

from draftsmith.serve.engine import Engine, EngineError, load_draft
from draftsmith.serve.engine_process import STOP, EngineLoop
from draftsmith.serve.sampling import SamplingParams
from draftsmith.serve.scheduler import Acceptance, Request, Scheduler, StepCostTable, bucket
from draftsmith.serve.weights import load_model
from tests.conftest import FAMILIES, save_tiny_head, save_tiny_model
from tests.test_sampling import PROMPT, VOCAB, chi_square_p, exact_joint, small_vocab_models  # noqa: F401
from tests.test_speculative import random_prompts


def engine_of(target_dir, draft_dir, batch: int, max_seq_len: int = 64, overlap: bool = False) -> Engine:
    # float64: the check is of the algorithm, not of float rounding between batch shapes. overlap: each step
    # is launched before the last one's tokens are handed out, as on a GPU
    return Engine(
        load_model(target_dir, torch.float64),
        load_model(draft_dir, torch.float64),
        max_batch_size=batch,
        max_seq_len=max_seq_len,
        overlap=overlap,
    )


def collect(scheduler: Scheduler, prompts, params, join_every: int = 0) -> tuple[list, list[int]]:
    """Submit the prompts with `params` (one for all, or one per prompt), one more every `join_every`
    steps (all at once when 0), and step until done; returns the completions in prompt order and the K
    of every speculative (K > 0) step."""
    results: dict[int, object] = {}
    streamed: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    ks: list[int] = []
    scheduler.on_step = lambda k, accepted: ks.append(k) if k else None
    per_prompt = params if isinstance(params, list) else [params] * len(prompts)

    def done(i: int, result) -> None:
        results[i] = result
        if not isinstance(result, BaseException):  # what on_tokens heard, in order, is the whole answer
            assert streamed[i] == result.tokens

    requests = [
        Request(list(p), q, on_tokens=streamed[i].extend, on_done=lambda r, i=i: done(i, r))
        for i, (p, q) in enumerate(zip(prompts, per_prompt))
    ]
    pending = list(requests)
    while pending or scheduler.num_running or scheduler.num_waiting or scheduler.in_flight:
        for _ in range(len(pending) if not join_every else 1):
            if pending:
                scheduler.submit(pending.pop(0))
        for _ in range(max(1, join_every)):
            scheduler.step()
    return [results[i] for i in range(len(prompts))], ks


@pytest.mark.parametrize("join_every,overlap", [(0, False), (1, False), (3, False), (1, True), (3, True)])
def test_requests_joining_a_running_batch_get_the_targets_greedy_output(tiny_models, join_every, overlap):
    target_dir, draft_dir = tiny_models["smollm2"]
    prompts = random_prompts(24, 97, seed=5)
    # rows finish at different steps; every fifth request's first token, read after the next step is launched
    # with its row in it, ends it
    lengths = [1 if i % 5 == 2 else 4 + (i * 7) % 13 for i in range(len(prompts))]
    alone = engine_of(target_dir, draft_dir, 1)
    expected = [alone.generate([p], SamplingParams(max_new_tokens=n)).completions[0].tokens for p, n in zip(prompts, lengths)]
    scheduler = Scheduler(engine_of(target_dir, draft_dir, 4, overlap=overlap), num_speculative_tokens=3, adaptive=False)
    completions, _ = collect(scheduler, prompts, [SamplingParams(max_new_tokens=n) for n in lengths], join_every)
    assert [c.tokens for c in completions] == expected


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_joining_a_running_batch_gets_batch_ones_greedy_output(tiny_models, family, tmp_path):
    """A draft model and an EAGLE-3 head per family, requests joining and leaving a batch of 4 under adaptive K:
    batch 1's plain greedy tokens, exactly (float64: a check of the algorithm, not of rounding at batch shapes)."""
    target_dir, draft_dir = tiny_models[family]
    target = load_model(target_dir, torch.float64)
    prompts = random_prompts(12, 97, seed=FAMILIES.index(family))
    params = [SamplingParams(max_new_tokens=4 + (i * 5) % 11) for i in range(len(prompts))]  # rows finish apart
    alone = Engine(target, max_seq_len=64)
    expected = [alone.generate([p], q).completions[0].tokens for p, q in zip(prompts, params)]
    head_dir = save_tiny_head(target_dir, tmp_path / "head", seed=FAMILIES.index(family))
    for draft in (draft_dir, head_dir):
        engine = Engine(target, load_draft(draft, torch.float64, "cpu"), max_batch_size=4, max_seq_len=64)
        completions, ks = collect(Scheduler(engine, num_speculative_tokens=3), prompts, params, join_every=1)
        assert [c.tokens for c in completions] == expected, draft.name
        assert ks  # speculative steps ran


def test_adaptive_k_speculates_with_a_good_draft_and_stops_with_a_useless_one(tiny_models, tmp_path):
    target_dir, _ = tiny_models["llama"]
    prompts = random_prompts(8, 97, seed=2)
    params = SamplingParams(max_new_tokens=24)
    # a step of K drafts: K draft forwards of 1 ms and a target forward over K+1 tokens of 11 + K ms
    costs = StepCostTable({(b, k): 11.0 + 2 * k for b in (1, 2, 4) for k in range(5)})
    expected = [c.tokens for c in engine_of(target_dir, target_dir, 4).generate(prompts[:4], params).completions]

    same = Scheduler(engine_of(target_dir, target_dir, 4), num_speculative_tokens=4)  # the target as its own draft
    same.costs = costs
    completions, ks = collect(same, prompts[:4], params)
    assert [c.tokens for c in completions] == expected
    assert ks == sorted(ks) and ks[-1] == 4  # every draft accepted: K climbs from the prior to the largest

    useless = save_tiny_model(tmp_path / "useless", "llama", seed=77, num_layers=1)
    bad = Scheduler(engine_of(target_dir, useless, 4), num_speculative_tokens=4)
    bad.costs = costs
    plain_steps = []
    bad_step = bad.step

    def counting_step():
        before = bad.plain_steps
        bad_step()
        plain_steps.append(bad.plain_steps > before)

    bad.step = counting_step
    completions, ks = collect(bad, prompts[:4], params)
    assert [c.tokens for c in completions] == expected
    assert sum(plain_steps) > len(plain_steps) / 2  # speculation turned off for most of the run
    assert all(k == 1 for k in ks[5:])  # after the first steps, only the periodic one-token probes


def test_best_k_follows_the_cost_model():
    target_ms = lambda k: 10.0 + 2 * (k + 1)  # the target over K+1 tokens
    costs = StepCostTable({(1, k): k * 1.0 + target_ms(k) for k in range(9)})
    assert costs.best_k(1, [0.0], 8) == 0  # nothing accepted: plain decoding is fastest
    assert costs.best_k(1, [0.99], 8) == 8
    middling = costs.best_k(1, [0.6], 8)
    assert 1 <= middling < 8
    expensive = StepCostTable({(1, k): k * 12.0 + target_ms(k) for k in range(9)})
    assert expensive.best_k(1, [0.6], 8) == 0  # a draft step as dear as the target's never pays
    assert [bucket(n, 12) for n in (1, 2, 3, 5, 9, 12)] == [1, 2, 4, 8, 12, 12]


def test_a_requests_acceptance_estimates_alpha_not_the_fraction_of_drafts_kept():
    # each draft kept with probability alpha while the ones before it were: a step of K keeps a geometric
    # run; the fraction kept (0.45 at alpha 0.8 and K = 7) would make adaptive K pick far too small a K
    import random

    target_ms = lambda k: 10.0 + 2 * (k + 1)
    costs = StepCostTable({(1, k): k * 1.0 + target_ms(k) for k in range(9)})
    for alpha, k in ((0.8, 7), (0.5, 3), (0.95, 5)):
        draw, acceptance, estimates, fractions = random.Random(0), Acceptance.prior(0.5), [], []
        for _ in range(3000):
            kept = 0
            while kept < k and draw.random() < alpha:
                kept += 1
            acceptance.record(k, kept)
            estimates.append(acceptance.alpha)
            fractions.append(kept / k)
        mean = sum(estimates[100:]) / len(estimates[100:])
        assert abs(mean - alpha) < 0.03, (alpha, k, mean)
        assert costs.best_k(1, [mean], 8) == costs.best_k(1, [alpha], 8)
        if alpha == 0.8:  # what a / K says of it
            assert sum(fractions) / len(fractions) < 0.5 and costs.best_k(1, [0.5], 8) < costs.best_k(1, [alpha], 8)
    assert Acceptance.prior(0.5).alpha == 0.5


def test_sampling_under_continuous_batching_follows_the_target(small_vocab_models):  # noqa: F811
    target_dir, draft_dir = small_vocab_models
    joint = exact_joint(target_dir, 1.0, 1.0)
    scheduler = Scheduler(engine_of(target_dir, draft_dir, 32, max_seq_len=12), num_speculative_tokens=2, adaptive=False, seed=7)
    samples = 6000
    # every other request with a seed of its own: those rows draw from their own generators
    params = [SamplingParams(temperature=1.0, max_new_tokens=3, ignore_eos=True, seed=1000 + i if i % 2 else None) for i in range(samples)]
    completions, _ = collect(scheduler, [PROMPT] * samples, params, join_every=1)
    tokens = np.array([c.tokens for c in completions])
    assert tokens.shape == (samples, 3)
    assert chi_square_p(tokens[:, 0] * VOCAB + tokens[:, 1], joint.sum(2)) > 1e-3
    assert chi_square_p(tokens[:, 1] * VOCAB + tokens[:, 2], joint.sum(0)) > 1e-3


@pytest.mark.parametrize("overlap", [False, True])
def test_a_cancelled_request_frees_its_row_and_too_long_requests_are_refused(tiny_models, overlap):
    target_dir, draft_dir = tiny_models["qwen2"]
    scheduler = Scheduler(engine_of(target_dir, draft_dir, 2, overlap=overlap), num_speculative_tokens=2, adaptive=False)
    done, heard = [], []
    request = Request([1, 2, 3], SamplingParams(max_new_tokens=40, ignore_eos=True), on_done=done.append, on_tokens=heard.append)
    scheduler.submit(request)
    for _ in range(3):
        scheduler.step()
    assert scheduler.num_running == 1 and len(done) == 0
    request.cancelled.set()
    before = len(heard)
    scheduler.step()
    assert scheduler.num_running == 0 and done == [] and len(heard) == before  # the step in flight is not handed out
    scheduler.drain()
    with pytest.raises(EngineError, match="exceed max_seq_len"):
        scheduler.submit(Request([1] * 30, SamplingParams(max_new_tokens=40)))


def test_the_engines_process_tells_the_server_of_a_row_a_late_cancellation_freed(tiny_models):
    """A cancellation the engine's process reads after the request's first step frees the row in a step that hands
    out nothing; the server still hears that nothing runs (it once kept counting the row for good)."""
    target_dir, draft_dir = tiny_models["qwen2"]
    scheduler = Scheduler(engine_of(target_dir, draft_dir, 2), num_speculative_tokens=2, adaptive=False)
    requests_in, requests_out = multiprocessing.Pipe(duplex=False)
    events_in, events_out = multiprocessing.Pipe(duplex=False)
    loop = threading.Thread(target=EngineLoop(scheduler, events_out).run, args=(requests_in,))
    loop.start()
    requests_out.send(("submit", 0, [1, 2, 3], SamplingParams(max_new_tokens=40, ignore_eos=True)))
    heard = [events_in.recv()]
    requests_out.send(("cancel", 0))
    while heard[-1][2:] != (0, 0) and events_in.poll(5):
        heard.append(events_in.recv())
    requests_out.send(STOP)
    loop.join()
    assert heard[0][2:] == (1, 0) and heard[-1][2:] == (0, 0)
    assert not any(e[0] == "done" for message in heard for e in message[1])  # cancelled: no one is told it finished


def test_requests_join_in_one_prefill_and_a_bad_one_fails_alone(tiny_models):
    target_dir, draft_dir = tiny_models["llama"]
    prompts = random_prompts(3, 97, seed=11)
    alone = engine_of(target_dir, draft_dir, 1)
    expected = [alone.generate([p], SamplingParams(max_new_tokens=6)).completions[0].tokens for p in prompts]
    engine = engine_of(target_dir, draft_dir, 4)
    forwards = []
    real_prefill = engine.prefill
    engine.prefill = lambda prompts, *a, **kw: forwards.append(len(prompts)) or real_prefill(prompts, *a, **kw)
    scheduler = Scheduler(engine, num_speculative_tokens=2, adaptive=False)
    completions, _ = collect(scheduler, prompts, SamplingParams(max_new_tokens=6))
    assert forwards == [3] and [c.tokens for c in completions] == expected  # three requests, one forward

    forwards.clear()
    results = {}
    doomed = prompts[1]  # a forward with this prompt in it fails, as one too big for the device would

    def failing(prompts, *a, **kw):
        forwards.append(len(prompts))
        if doomed in prompts:
            raise torch.OutOfMemoryError("injected")
        return real_prefill(prompts, *a, **kw)

    engine.prefill = failing
    for i, p in enumerate(prompts):
        scheduler.submit(Request(list(p), SamplingParams(max_new_tokens=6), on_done=lambda r, i=i: results.__setitem__(i, r)))
    while scheduler.num_running or scheduler.num_waiting:
        scheduler.step()
    assert forwards == [3, 1, 1, 1]  # the batch failed, so each went alone
    assert isinstance(results[1], torch.OutOfMemoryError)
    assert results[0].tokens == expected[0] and results[2].tokens == expected[2]


def test_a_seeded_request_gets_the_same_tokens_alone_or_joining_a_busy_batch(tiny_models):
    """At a fixed K a seeded request draws from its own generator only, so its neighbours and the step it
    joins at do not change its tokens."""
    target_dir, draft_dir = tiny_models["mistral"]
    seeded = SamplingParams(temperature=1.0, max_new_tokens=10, seed=5, ignore_eos=True)
    others = SamplingParams(temperature=0.8, max_new_tokens=14, ignore_eos=True)
    prompts = random_prompts(5, 97, seed=3)
    alone, _ = collect(
        Scheduler(engine_of(target_dir, draft_dir, 4), num_speculative_tokens=2, adaptive=False, seed=1), [prompts[0]], seeded
    )
    for join_every, overlap in ((0, False), (2, False), (2, True)):
        crowd, _ = collect(
            Scheduler(engine_of(target_dir, draft_dir, 4, overlap=overlap), num_speculative_tokens=2, adaptive=False, seed=2),
            prompts[1:3] + [prompts[0]] + prompts[3:],
            [others, others, seeded, others, others],
            join_every,
        )
        assert crowd[2].tokens == alone[0].tokens
        assert crowd[0].tokens != crowd[1].tokens or prompts[1] != prompts[2]
    other_seed, _ = collect(
        Scheduler(engine_of(target_dir, draft_dir, 4), num_speculative_tokens=2, adaptive=False),
        [prompts[0]],
        SamplingParams(temperature=1.0, max_new_tokens=10, seed=6, ignore_eos=True),
    )
    assert other_seed[0].tokens != alone[0].tokens


@pytest.mark.parametrize("adaptive", [False, True])
def test_prompt_lookup_through_the_scheduler_reads_each_rows_text_so_far(tiny_models, adaptive):
    # prompt lookup drafts from the row's text: its steps are handed out before the next launch, and a plain
    # step left in flight (adaptive K at 0) is handed out before a lookup step reads the text
    from draftsmith.serve.proposers import PromptLookup

    target_dir, _ = tiny_models["smollm2"]
    target = load_model(target_dir, torch.float64)
    engine = Engine(target, None, max_batch_size=4, max_seq_len=64, overlap=True)
    prompts = [[i % 5 + j for i in range(12)] for j in range(10)]  # repetitive: lookup finds matches
    params = SamplingParams(max_new_tokens=16)
    expected = [engine.generate([p], params).completions[0].tokens for p in prompts]
    lookup = PromptLookup(target.args.vocab_size)
    scheduler = Scheduler(engine, num_speculative_tokens=3, adaptive=adaptive, proposer=lookup)
    if adaptive:  # the lookup's own steps timed (no draft model here); then plain steps cost a third of a
        scheduler.warm_up(full=False, batch_sizes=[1])  # lookup step's: adaptive K runs plain with probes
        assert set(scheduler.costs.step_ms) == {(1, k) for k in range(4)}
        scheduler.costs = StepCostTable({(b, k): 1.0 + (2.0 if k else 0.0) for b in (1, 2, 4) for k in range(4)})
    completions, ks = collect(scheduler, prompts, params, join_every=1)
    assert [c.tokens for c in completions] == expected and ks  # lookup steps ran (probes, under adaptive K)
    fixed = Scheduler(engine, num_speculative_tokens=3, adaptive=False, proposer=lookup)
    _, steps, stats = fixed.run_all(prompts, params)
    _, plain_steps, _ = Scheduler(engine, num_speculative_tokens=0, adaptive=False).run_all(prompts, params)
    assert stats.num_accepted_tokens > 0 and steps < plain_steps
    with pytest.raises(EngineError, match="draft"):
        Scheduler(engine, num_speculative_tokens=3)


def test_a_draft_model_keeps_up_through_plain_steps(tiny_models):
    """Adaptive K turns speculation off (K = 0) and on again: a draft model reads what each plain step
    fed the target, so that when drafting resumes its cache holds every position. With a draft identical
    to the target every greedy draft is then kept, however the plain and speculative steps alternate
    (before the fix a row kept none for the rest of its request after 6 plain steps), and the output is
    still the target's."""
    target_dir, _ = tiny_models["llama"]
    prompts = random_prompts(3, 97, seed=1)
    params = SamplingParams(max_new_tokens=40)
    expected = [c.tokens for c in engine_of(target_dir, target_dir, 3).generate(prompts, params).completions]
    script = [0] * 6 + [3, 3, 0, 2, 0, 0, 0, 3, 1, 0, 3] * 4

    class Scripted(Scheduler):  # the K of each step, as adaptive K might choose them
        def _choose_k(self, n, alphas):
            return script.pop(0) if script else 2

    scheduler = Scripted(engine_of(target_dir, target_dir, 4), num_speculative_tokens=3, adaptive=True)
    steps = []
    scheduler.on_step = lambda k, accepted: steps.append((k, accepted))
    done = {}
    for i, prompt in enumerate(prompts):
        scheduler.submit(Request(list(prompt), params, on_done=lambda r, i=i: done.__setitem__(i, r)))
    scheduler.drain()
    assert [done[i].tokens for i in range(3)] == expected
    speculative = [(k, accepted) for k, accepted in steps if k > 0]
    assert len(speculative) >= 6 and steps[6][0] == 3
    for k, accepted in speculative:
        assert accepted == [k] * len(accepted), (k, accepted)
