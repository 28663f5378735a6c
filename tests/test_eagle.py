"""EAGLE-3 heads: training-time test unrolls the head exactly as inference runs it; training lowers the
loss, raises acceptance and resumes where it stopped; decoding with a head (or with a draft model on a
vocabulary subset) is lossless: greedy output equals the target's token for token, and sampled output
follows the target's distribution (chi-square, bonus token observed)."""

import random

import numpy as np
import pytest
import torch

from draftsmith.distill import eagle
from draftsmith.distill.train import Distiller
from draftsmith.pipeline.config import DistillConfig
from draftsmith.serve import eagle as serve_eagle
from draftsmith.serve.eagle import load_head
from draftsmith.serve.engine import Engine
from draftsmith.serve.proposers import EagleProposer
from draftsmith.serve.sampling import SamplingParams
from draftsmith.serve.weights import load_model
from tests.conftest import save_tiny_head, tiny_distill_config
from tests.test_sampling import PROMPT, SAMPLES, VOCAB, chi_square_p, exact_joint, small_vocab_models  # noqa: F401
from tests.test_speculative import random_prompts


def distill_config(max_steps: int = 150, eval_every: int = 50) -> DistillConfig:
    return tiny_distill_config(
        teacher={"max_new_tokens": 24, "batch_size": 16},
        learning_rate=3e-3,
        warmup_steps=5,
        max_steps=max_steps,
        batch_size=16,
        eval_every=eval_every,
        max_seq_len=64,
    )


def greedy_rows(target_dir, n: int = 256, new_tokens: int = 24) -> list[dict]:
    """The target's greedy continuations of random prompts as teacher rows, one in eight held out."""
    engine = Engine(load_model(target_dir, torch.float32), max_batch_size=64, max_seq_len=64)
    rng = random.Random(0)
    prompts = [[rng.randrange(97) for _ in range(rng.randint(2, 8))] for _ in range(n)]
    rows = []
    for i in range(0, n, 64):
        got = engine.generate(prompts[i : i + 64], SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
        rows += [
            {"id": str(j), "prompt_ids": c.prompt_tokens, "response_ids": c.tokens, "split": "eval" if j % 8 == 0 else "train"}
            for j, c in enumerate(got.completions, i)
        ]
    return rows


def distiller(target_dir, rows, work_dir, cfg: DistillConfig, log=lambda step, m: None) -> Distiller:
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    aux = eagle.resolve_aux_layers([], 3)
    head, layer_config = eagle.build_head(target_dir, 1, aux, list(range(97)), seed=0)
    objective = eagle.EagleObjective(cfg, aux, list(range(97)), layer_config, {"name_or_path": str(target_dir), "architectures": []})
    student = eagle.UnrolledHead(head, target.get_input_embeddings(), steps=4, decay=0.8)
    train = [r for r in rows if r["split"] == "train"]
    return Distiller(cfg, student, target, objective, train, [r for r in rows if r["split"] == "eval"], work_dir, 0, cpu=True, log=log)


@pytest.fixture(scope="module")
def trained(tiny_models, tmp_path_factory):
    """A head trained for 150 steps on the tiny SmolLM2-shaped target's own greedy text."""
    target_dir = tiny_models["smollm2"][0]
    tmp = tmp_path_factory.mktemp("eagle")
    rows = greedy_rows(target_dir)
    d = distiller(target_dir, rows, tmp / "work", distill_config())
    result = d.train()
    d.save_draft(tmp / "head")
    return target_dir, tmp / "head", result["history"], rows


def test_the_unrolled_head_is_what_inference_runs(tiny_models, tmp_path):
    """Step j of training-time test at entry t equals the head after inference's catch-up and j own steps."""
    target_dir = tiny_models["smollm2"][0]
    head = load_head(save_tiny_head(target_dir, tmp_path / "h", seed=2), torch.float64)
    target = load_model(target_dir, torch.float64)
    sequence = torch.tensor([random_prompts(1, 97, seed=1)[0][:1] + list(range(3, 17))])  # [1, 15]
    target.setup_cache(1, 32)
    _, features = target(sequence, torch.arange(15)[None], hidden_layers=head.aux_layers)
    steps = list(head.unroll(sequence, features, target.tok_embeddings, 4))  # [1, 14, hidden] each
    for L in (1, 5, 9):  # prompts of L tokens, the token at L sampled after them
        target.setup_cache(1, 32)
        head.setup_cache(1, 32)
        proposer = EagleProposer(head, target.tok_embeddings)
        _, prompt_features = target(sequence[:, :L], torch.arange(L)[None], hidden_layers=head.aux_layers)
        hidden = proposer.prefill(sequence[:, :L], torch.arange(L)[None], torch.tensor([L]), sequence[:, L], prompt_features, None)
        assert torch.allclose(hidden, steps[0][:, L - 1], atol=1e-12)
        for j in range(1, 4):  # the next drafts, as if each earlier one had been the data's token
            hidden = head(target.tok_embeddings(sequence[:, L + j : L + j + 1]), hidden.unsqueeze(1), torch.tensor([[L - 1 + j]]))[:, 0]
            assert torch.allclose(hidden, steps[j][:, L - 1], atol=1e-12), (L, j)


def test_training_lowers_the_loss_and_raises_acceptance(trained):
    _, _, history, _ = trained
    first, last = history[0], history[-1]
    assert last["eval_loss"] < 0.8 * first["eval_loss"], history
    assert last["eval_alpha_1"] > first["eval_alpha_1"] + 0.05 and last["eval_tau_4"] > first["eval_tau_4"], history


def test_greedy_with_a_head_equals_target_greedy(trained):
    target_dir, head_dir, _, rows = trained
    target, head = load_model(target_dir, torch.float64), load_head(head_dir, torch.float64)
    prompts = [r["prompt_ids"] for r in rows if r["split"] == "eval"][:24]
    params = SamplingParams(max_new_tokens=16)
    one, four = Engine(target, head, max_batch_size=1, max_seq_len=64), None
    expected = [one.generate([p], params).completions[0].tokens for p in prompts]
    four = Engine(load_model(target_dir, torch.float64), load_head(head_dir, torch.float64), max_batch_size=4, max_seq_len=64)
    accepted = 0
    for k in range(1, 9):
        for i in range(0, len(prompts), 4):
            got = four.generate(prompts[i : i + 4], params, num_speculative_tokens=k)
            assert [c.tokens for c in got.completions] == expected[i : i + 4], f"K={k}, prompts {i}..{i + 3}"
            accepted += got.stats.num_accepted_tokens
        for i in range(0, len(prompts), 6):
            assert one.generate([prompts[i]], params, num_speculative_tokens=k).completions[0].tokens == expected[i], f"K={k}, batch 1"
    assert accepted > 50  # the trained head is accepted often: acceptance paths run


@pytest.mark.parametrize("group", [1, 5])
def test_training_resumes_where_it_stopped(tiny_models, tmp_path, group):
    """A run stopped after its first checkpoint and started again ends where an uninterrupted one ends, bit for bit
    with the target run at every step (kept states are recomputed after a restart, in other batches: equal up to
    float rounding only); with length-grouped steps too, stopped inside a group."""
    from dataclasses import replace

    target_dir = tiny_models["smollm2"][0]
    rows = greedy_rows(target_dir, n=64)
    cfg = replace(distill_config(max_steps=8, eval_every=4), target_states_gib=0.0, length_group_steps=group)
    whole = distiller(target_dir, rows, tmp_path / "whole", cfg)
    whole.train()

    def stop_at_six(step, metrics):
        if step == 6:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        distiller(target_dir, rows, tmp_path / "stopped", cfg, log=stop_at_six).train()
    resumed = distiller(target_dir, rows, tmp_path / "stopped", cfg)
    history = resumed.train()["history"]
    assert [h["step"] for h in history] == [0, 4, 8]
    for a, b in zip(whole.draft.parameters(), resumed.draft.parameters()):
        assert torch.equal(a, b)


def test_length_grouped_steps_take_the_same_rows_in_batches_of_like_length(tiny_models, tmp_path):
    """distill.length_group_steps = 4: the four steps of a group take the rows the four would have taken ungrouped,
    each once, cut from their order by length, so one step's lengths do not overlap another's."""
    from dataclasses import replace

    target_dir = tiny_models["smollm2"][0]
    rng = random.Random(0)
    rows = [
        {"id": str(i), "prompt_ids": [5] * rng.randint(2, 8), "response_ids": [7] * rng.randint(1, 20), "split": "train"} for i in range(40)
    ]
    steps = {}
    for group in (1, 4):
        d = distiller(target_dir, rows, tmp_path / str(group), replace(distill_config(), batch_size=8, length_group_steps=group))
        steps[group] = [d._micro_batches(step)[0] for step in range(8)]
    length = lambda r: len(r["prompt_ids"]) + len(r["response_ids"])
    for first in (0, 4):
        grouped, plain = steps[4][first : first + 4], steps[1][first : first + 4]
        assert sorted(r["id"] for b in grouped for r in b) == sorted(r["id"] for b in plain for r in b)
        spans = sorted((min(map(length, b)), max(map(length, b))) for b in grouped)
        assert all(high <= low for (_, high), (low, _) in zip(spans, spans[1:]))
        assert max(h - lo for lo, h in spans) < max(max(map(length, b)) - min(map(length, b)) for b in plain)
    assert steps[4][:4] != sorted(steps[4][:4], key=lambda b: length(b[0]))  # the slices in a seeded order, not by length


def head_samples(target_dir, head_dir, params: SamplingParams, k: int) -> tuple[np.ndarray, object]:
    engine = Engine(load_model(target_dir, torch.float64), load_head(head_dir, torch.float64), max_batch_size=SAMPLES, max_seq_len=12)
    got = engine.generate([PROMPT] * SAMPLES, params, num_speculative_tokens=k)
    return np.array([c.tokens[:3] for c in got.completions]), got.stats


@pytest.mark.parametrize("k", [1, 2])
def test_sampling_with_a_head_on_a_vocabulary_subset_follows_the_target(small_vocab_models, tmp_path, k):  # noqa: F811
    # the head proposes from 8 of the 12 tokens: the other 4 come only from corrections and bonuses.
    # K=1 observes the bonus token (tokens 2 and 3 are the draft or its correction, then the bonus)
    target_dir, _ = small_vocab_models
    head_dir = save_tiny_head(target_dir, tmp_path / "head", seed=5, vocab=[0, 1, 2, 4, 5, 7, 8, 10])
    joint = exact_joint(target_dir, 1.0, 1.0)
    tokens, stats = head_samples(target_dir, head_dir, SamplingParams(temperature=1.0, seed=4321, max_new_tokens=3), k)
    assert 0.05 < stats.acceptance_rate < 0.95
    second_third = chi_square_p(tokens[:, 1] * VOCAB + tokens[:, 2], joint.sum(0))
    assert second_third > 1e-3, second_third


def test_a_draft_model_on_a_vocabulary_subset_stays_lossless(small_vocab_models, tiny_models):  # noqa: F811
    from tests.test_sampling import speculative_samples

    target_dir, draft_dir = small_vocab_models
    subset = torch.tensor([0, 2, 3, 5, 6, 9, 11])
    joint = exact_joint(target_dir, 1.0, 1.0)
    tokens, stats = speculative_samples(
        target_dir, draft_dir, SamplingParams(temperature=1.0, seed=77, max_new_tokens=3), vocab=subset, k=1
    )
    assert 0.05 < stats.acceptance_rate < 0.95
    assert chi_square_p(tokens[:, 1] * VOCAB + tokens[:, 2], joint.sum(0)) > 1e-3
    # greedy: a token outside the subset is never proposed, and the output is the target's
    big_target, big_draft = tiny_models["llama"]
    target, draft = load_model(big_target, torch.float64), load_model(big_draft, torch.float64)
    draft.use_vocab(torch.arange(0, 97, 2))
    engine = Engine(target, draft, max_batch_size=4, max_seq_len=64)
    prompts = random_prompts(8, 97, seed=8)
    params = SamplingParams(max_new_tokens=16)
    expected = [c.tokens for i in (0, 4) for c in engine.generate(prompts[i : i + 4], params).completions]
    for k in (1, 3):
        assert [c.tokens for i in (0, 4) for c in engine.generate(prompts[i : i + 4], params, k).completions] == expected


def test_a_head_made_for_another_target_is_refused(tiny_models, tmp_path):
    from draftsmith.serve.engine import EngineError

    head_dir = save_tiny_head(tiny_models["smollm2"][0], tmp_path / "h", seed=1)  # hidden size 96
    with pytest.raises(EngineError, match="target_hidden_size 96 != the target's hidden size 64"):
        Engine(load_model(tiny_models["llama"][0]), load_head(head_dir))


def test_draft_vocabulary_is_the_most_frequent_tokens_then_the_lowest_ids():
    data = [[5, 5, 5, 9, 9, 3], [9, 7]]
    assert eagle.draft_vocabulary(data, 20, 2) == [5, 9]
    assert eagle.draft_vocabulary(data, 20, 6) == [0, 1, 3, 5, 7, 9]  # 4 seen, then the lowest unseen
    assert eagle.draft_vocabulary(data, 20, 0) == list(range(20))
    assert eagle.coverage(data, [5, 9]) == pytest.approx(6 / 8)
    # the size sweep: tokens 0-1499 twice each, then 1500-2499 once; sizes under the target's 3,000 tokens only
    train = [[t, t] for t in range(1500)] + [[t] for t in range(1500, 2500)]
    assert eagle.coverage_by_size(train, [[10, 1100, 2400, 2999]], 3000) == {"1024": 0.25, "2048": 0.5}
    with pytest.raises(eagle.EagleConfigError, match="draft.aux_layers"):
        eagle.resolve_aux_layers([1, 40], 30)
    assert eagle.resolve_aux_layers([], 30) == (2, 15, 27)  # vLLM's default: an early, a middle and a late layer


def test_kept_target_states_train_the_head_as_the_online_target_does(tiny_models, tmp_path):
    # the target's features and final states kept from the first forward over each row: the same losses, step for
    # step, as running the target every time (distill.target_states_gib=0), and the second epoch runs no target
    from dataclasses import replace

    target_dir = tiny_models["smollm2"][0]
    rows = greedy_rows(target_dir, n=64)
    histories, forwards = {}, {}
    for gib in (0.0, 1.0):
        d = distiller(target_dir, rows, tmp_path / f"work{gib}", replace(distill_config(max_steps=12, eval_every=6), target_states_gib=gib))
        calls, original = [], d.objective.row_states
        d.objective.row_states = lambda target, batch, original=original, calls=calls: calls.append(1) or original(target, batch)
        histories[gib], forwards[gib] = d.train()["history"], len(calls)
    for key in ("eval_loss", "train_loss"):
        online, kept = ([h[key] for h in histories[gib] if key in h] for gib in (0.0, 1.0))
        assert kept == pytest.approx(online, rel=1e-5), key
    assert forwards[1.0] < forwards[0.0]  # the second epoch's batches and the second evaluation run no target


def test_a_head_whose_compiling_fails_trains_on_uncompiled(tiny_models, tmp_path, failing_compiler):
    """Where torch.compile's backend fails (injected: compiling for a CPU does not fail), here in the target's layers
    at the first held-out evaluation, the head trains on uncompiled, its unroll back to the written-out attention,
    with the uncompiled run's losses."""
    from dataclasses import replace

    target_dir = tiny_models["smollm2"][0]
    rows = greedy_rows(target_dir, n=64)
    results, students = {}, {}
    for compiled in (False, True):
        d = distiller(target_dir, rows, tmp_path / str(compiled), replace(distill_config(max_steps=6, eval_every=3), compile=compiled))
        results[compiled], students[compiled] = d.train(), d.accelerator.unwrap_model(d.draft)
    assert results[True]["compile_failed_at_step"] == 0 and students[True].compiled is None
    for key in ("eval_loss", "train_loss"):
        plain, fell_back = ([h[key] for h in results[c]["history"] if key in h] for c in (False, True))
        assert fell_back == pytest.approx(plain, rel=1e-5), key


def test_the_indexed_loss_is_the_masked_definition(tiny_models):
    """Training gathers each step's entries by indices made on the host (no device sync) and takes the loss chunk
    by chunk: the same loss, gradient and acceptance counts as selecting by boolean masks over the whole
    [B, E] unroll, as the module's docstring defines them. One row has a one-token prompt, whose first
    response position no step reads."""
    from torch.nn import functional as F

    from draftsmith.distill import losses
    from draftsmith.distill.train import collate

    target_dir = tiny_models["smollm2"][0]
    vocab = list(range(0, 97, 2))
    head, _ = eagle.build_head(target_dir, 1, eagle.resolve_aux_layers([], 3), vocab, seed=3)
    embeddings = torch.nn.Embedding(97, 96)
    g = torch.Generator().manual_seed(0)
    rows = [
        {"prompt_ids": torch.randint(97, (n,), generator=g).tolist(), "response_ids": torch.randint(97, (m,), generator=g).tolist()}
        for n, m in ((1, 6), (4, 9), (7, 3), (2, 12))
    ]
    batch = collate(rows, 64, torch.device("cpu"))
    B, S = batch.input_ids.shape
    features = torch.randn(B, S, 3 * 96, generator=g)
    all_logits = torch.randn(B, S, len(vocab), generator=g)  # the target's, at every position
    loss_fn = losses.against_logits("forward_kl", 1.0, 0.5)

    # the definition: step j's entry t is wanted where position t + j + 1 predicts a response token
    expected_loss, expected = torch.zeros(()), {}
    correct = torch.ones(B, S - 1, dtype=torch.bool)
    head.zero_grad()
    for j, hidden in enumerate(head.unroll(batch.input_ids, features, embeddings, 4)):
        wanted = F.pad(batch.predict[:, j + 1 :], (0, j))
        q = head.logits(hidden[wanted])
        expected_loss = expected_loss + 0.8**j * loss_fn(q, F.pad(all_logits[:, j + 1 :], (0, 0, 0, j))[wanted]).mean()
        agree = torch.zeros_like(correct)
        agree[wanted] = head.vocab[q.argmax(-1)] == F.pad(batch.input_ids[:, j + 2 :], (0, j + 1))[wanted]
        correct &= agree
        expected[f"accepted_{j}"], expected[f"drafted_{j}"] = (correct & wanted).sum().item(), wanted.sum().item()
    expected_loss = expected_loss / sum(0.8**j for j in range(4))
    expected_loss.backward()
    expected_grads = [p.grad.clone() for p in head.parameters()]

    target_logits = all_logits.flatten(0, 1)[batch.predict_index]
    for chunk in (0, 5):
        head.zero_grad()
        student = eagle.UnrolledHead(head, embeddings, steps=4, decay=0.8, chunk=chunk)
        index = eagle.UnrollIndex.of(batch, 4)
        # step j reads response positions s > j: the one-token prompt's s = 0 at no step, its s = 1 and the
        # two-token prompt's s = 1 at step 0 only
        assert len(index.entries[0]) == batch.num_targets - 1 and len(index.entries[1]) == batch.num_targets - 3
        loss, metrics = student(batch.input_ids, features, target_logits, index, loss_fn, batch.labels)
        loss.backward()
        torch.testing.assert_close(loss, expected_loss)
        assert {k: v.item() for k, v in metrics.items() if k != "tvd_0"} == expected
        for p, want in zip(head.parameters(), expected_grads):
            torch.testing.assert_close(p.grad, want, rtol=1e-4, atol=1e-6)


def uneven_case(tiny_models, layers: int):
    """A head of `layers` layers, an embedding and a batch of rows of uneven lengths (one prompt longer than the
    unroll, one of two tokens), with random target features and logits."""
    from draftsmith.distill.train import collate

    target_dir = tiny_models["smollm2"][0]
    head, _ = eagle.build_head(target_dir, layers, eagle.resolve_aux_layers([], 3), list(range(0, 97, 2)), seed=4)
    g = torch.Generator().manual_seed(1)
    rows = [
        {"prompt_ids": torch.randint(97, (n,), generator=g).tolist(), "response_ids": torch.randint(97, (m,), generator=g).tolist()}
        for n, m in ((3, 20), (9, 5), (2, 31))
    ]
    batch = collate(rows, 64, torch.device("cpu"))
    features = torch.randn(*batch.input_ids.shape, 3 * 96, generator=g)
    return head, torch.nn.Embedding(97, 96), batch, features, torch.randn(batch.num_targets, 49, generator=g)


def test_later_steps_at_the_window_train_as_every_entry_does(tiny_models):
    """The steps after the first run only at each row's window of entries that a loss reads: with two layers (the
    second attends to the first's keys at every step), the same loss, gradient and acceptance counts as the whole
    unroll, and the window is narrower than the rows."""
    from draftsmith.distill import losses

    head, embeddings, batch, features, logits = uneven_case(tiny_models, layers=2)
    loss_fn = losses.against_logits("forward_kl", 1.0, 0.5)
    index = eagle.UnrollIndex.of(batch, 4)
    assert index.window.shape[1] < batch.input_ids.shape[1] - 1
    results = []
    for windowed in (True, False):
        head.zero_grad()
        loss, metrics = eagle.UnrolledHead(head, embeddings, 4, 0.8, windowed=windowed)(
            batch.input_ids, features, logits, index, loss_fn, batch.labels
        )
        loss.backward()
        results.append((loss.detach(), {k: v.item() for k, v in metrics.items()}, [p.grad.clone() for p in head.parameters()]))
    (loss, metrics, grads), (whole_loss, whole_metrics, whole_grads) = results
    torch.testing.assert_close(loss, whole_loss)
    assert metrics == pytest.approx(whole_metrics)
    for a, b in zip(grads, whole_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_the_later_steps_trace_into_one_graph_and_the_first_breaks_only_at_its_attention(tiny_models):
    """distill.compile compiles the windowed unroll's later steps whole (each graph break would be a compiled piece of
    its own to launch, forward and backward, every step); step 0 breaks where each layer's attention leaves compiled
    code (inside it, inductor failed on an H200) and nowhere else."""
    head, embeddings, batch, features, _ = uneven_case(tiny_models, layers=2)
    index = eagle.UnrollIndex.of(batch, 4)
    student = eagle.UnrolledHead(head, embeddings, 4, 0.8)
    _, hidden, kv = student._first(batch.input_ids, features, index.at[0])
    later = torch._dynamo.explain(student._later)(hidden, kv, batch.input_ids, index.window, index.at[1:])
    assert (later.graph_count, later.graph_break_count) == (1, 0)
    with torch.no_grad():  # through FlexAttention too (traced without gradients: it has no backward on a CPU)
        later = torch._dynamo.explain(student._later)(hidden, kv, batch.input_ids, index.window, index.at[1:], True)
    assert (later.graph_count, later.graph_break_count) == (1, 0)
    first = torch._dynamo.explain(student._first)(batch.input_ids, features, index.at[0])
    reasons = [reason.reason for reason in first.break_reasons]
    assert len(reasons) == 2 and all("_attend_eagerly" in reason for reason in reasons), reasons  # one a layer


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiling for a CPU takes minutes")
def test_the_compiled_unroll_trains_the_head_as_the_whole_unroll_does(tiny_models):
    from draftsmith.distill import losses

    head, embeddings, batch, features, logits = uneven_case(tiny_models, layers=2)
    head, embeddings, features, logits = head.cuda(), embeddings.cuda(), features.cuda(), logits.cuda()
    loss_fn = losses.against_logits("forward_kl", 1.0, 0.5)
    batch.input_ids, batch.labels = batch.input_ids.cuda(), batch.labels.cuda()
    index = eagle.UnrollIndex.of(batch, 4)
    results = []
    for compiled in (False, True):  # compiled on CUDA: the later steps attend through FlexAttention
        student = eagle.UnrolledHead(head, embeddings, 4, 0.8, chunk=16, windowed=compiled)
        head.zero_grad()
        if compiled:
            student.compile_training()
        loss, _ = student(batch.input_ids, features, logits, index, loss_fn)
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in head.parameters()]))
    (whole, whole_grads), (compiled, compiled_grads) = results
    torch.testing.assert_close(compiled, whole)
    for a, b in zip(compiled_grads, whole_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("softcap", [None, 30.0])
def test_flex_window_attention_reads_what_the_written_out_one_reads(softcap):
    """FlexAttention over step 0's keys and the window's own side by side, under a block mask, gives window_attention's
    output: grouped query heads, entries at a row's start and at its end, a Gemma 2 softcap (forward only: FlexAttention
    has no backward on a CPU; the GPU test trains through it)."""
    from dataclasses import replace

    from draftsmith.serve.model import Attention, ModelArgs

    config = {"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 2, "intermediate_size": 128, "num_hidden_layers": 1}
    args = replace(ModelArgs.from_hf_config({**config, "vocab_size": 97, "model_type": "llama"}), attn_softcap=softcap)
    attention = Attention(args)
    g = torch.Generator().manual_seed(2)
    B, W, E, H, kv_heads, D = 3, 17, 40, 6, 2, 16
    entries = (torch.arange(W) + torch.tensor([0, 10, 30])[:, None]).clamp(max=E - 1)  # the last row's window runs past its end
    for j in (1, 3):
        q, keys, values = (
            torch.randn(B, W, H, D, generator=g),
            torch.randn(B, kv_heads, E, D, generator=g),
            torch.randn(B, kv_heads, E, D, generator=g),
        )
        own_keys, own_values = (torch.randn(B, W, j, kv_heads, D, generator=g) for _ in range(2))
        with torch.no_grad():
            written_out = serve_eagle.window_attention(attention, q, keys, values, entries, own_keys, own_values)
            flex = serve_eagle.flex_window_attention(attention, q, keys, values, entries, own_keys, own_values)
        torch.testing.assert_close(flex, written_out, rtol=1e-4, atol=1e-5)
