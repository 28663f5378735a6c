"""CUDA graphs change speed, not output: graphed forwards and whole-step graphs against eager decoding.

Needs a GPU (CI has none, so these are skipped there); run on the GPU machine with
`python3 -m pytest -q tests/test_cuda_graphs.py`.
"""

import pytest
import torch

from draftsmith.serve.eagle import load_head
from draftsmith.serve.engine import Engine
from draftsmith.serve.proposers import LookupFirst, PromptLookup
from draftsmith.serve.sampling import SamplingParams
from draftsmith.serve.scheduler import Request, Scheduler
from draftsmith.serve.weights import load_model
from tests.conftest import FAMILIES, save_tiny_head
from tests.test_speculative import random_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


@pytest.fixture(scope="module", params=["draft model", "eagle3"])
def kind(request):
    return request.param


@pytest.fixture(scope="module")
def head_dir(tiny_models, tmp_path_factory):
    return save_tiny_head(tiny_models["smollm2"][0], tmp_path_factory.mktemp("head") / "head", seed=1)


def engine(tiny_models, dtype, batch, graphs, compile_blocks=False, kind="draft model", head_dir=None):
    target_dir, draft_dir = tiny_models["smollm2"]
    target = load_model(target_dir, dtype, "cuda")
    draft = load_head(head_dir, dtype, "cuda") if kind == "eagle3" else load_model(draft_dir, dtype, "cuda")
    return Engine(target, draft, max_batch_size=batch, max_seq_len=96, cuda_graphs=graphs, compile_blocks=compile_blocks)


def outputs(e, prompts, k, batch, params=SamplingParams(max_new_tokens=24)):
    return [
        c.tokens
        for i in range(0, len(prompts), batch)
        for c in e.generate(prompts[i : i + batch], params, num_speculative_tokens=k).completions
    ]


def test_step_graphs_equal_eager_decoding(tiny_models, kind, head_dir):
    # float64 and no compiling: graphs replay the eager kernels, so outputs must match exactly
    prompts = random_prompts(16, 97, seed=3)
    eager = engine(tiny_models, torch.float64, 4, False, kind=kind, head_dir=head_dir)
    graphed = engine(tiny_models, torch.float64, 4, True, kind=kind, head_dir=head_dir)
    expected = outputs(eager, prompts, 0, 4)
    for k in (1, 3, 5):  # the heads' catch-up in the graph keeps them where eager decoding keeps them
        assert (
            eager.generate(prompts[:4], SamplingParams(max_new_tokens=24), k).stats.as_dict()
            == graphed.generate(prompts[:4], SamplingParams(max_new_tokens=24), k).stats.as_dict()
        ), f"K={k}"
    for k in (0, 1, 3, 5):
        assert outputs(graphed, prompts, k, 4) == expected, f"K={k}"
        assert outputs(graphed, prompts[:4], k, 1) == expected[:4], f"K={k}, batch 1"
    assert {(4, 0, "draft"), (4, 3, "draft"), (1, 5, "draft")} <= set(graphed.step_graphs.graphs)  # the steps did run as whole-step graphs


def test_lookup_drafts_in_step_graphs_equal_eager_decoding(tiny_models, kind, head_dir):
    """Prompt lookup's drafts, searched inside the steps' graphs, and lookup first's where rows repeat themselves,
    copied into them: the same tokens and the same acceptance as the same proposers run eagerly."""
    prompts = [[i % 4 + j for i in range(12)] for j in range(4)] + random_prompts(4, 97, seed=3)
    eager = engine(tiny_models, torch.float64, 4, False, kind=kind, head_dir=head_dir)
    graphed = engine(tiny_models, torch.float64, 4, True, kind=kind, head_dir=head_dir)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    for k, batch in ((3, 4), (5, 1)):
        for name, proposer in (("lookup", lambda e: PromptLookup(97)), ("lookup first", lambda e: LookupFirst(e.draft_proposer, 97, 1))):
            got = [
                [e.generate(prompts[i : i + batch], params, k, proposer=proposer(e)) for i in range(0, len(prompts), batch)]
                for e in (eager, graphed)
            ]
            tokens = [[c.tokens for run in runs for c in run.completions] for runs in got]
            assert tokens[0] == tokens[1], f"{name}, K={k}, batch {batch}"
            stats = [[run.stats.as_dict() for run in runs] for runs in got]
            assert stats[0] == stats[1], f"{name}, K={k}, batch {batch}"
    drafted = {key[2] for key in graphed.step_graphs.graphs}
    assert {("lookup", 3, 1), "given", "mixed"} <= drafted, drafted


def test_scheduler_with_step_graphs_equals_eager(tiny_models, kind, head_dir):
    prompts = random_prompts(12, 97, seed=4)
    params = SamplingParams(max_new_tokens=20)
    expected = outputs(engine(tiny_models, torch.float64, 1, False), prompts, 0, 1, params)
    scheduler = Scheduler(engine(tiny_models, torch.float64, 4, True, kind=kind, head_dir=head_dir), 3)
    scheduler.warm_up()
    # the warm-up's captured prefills hold no autograd graph (one did, and ran an H200 out of memory)
    prefills = scheduler.engine.target_prefill.graphs.values()
    assert prefills and all(t.grad_fn is None for _, _, out in prefills for t in (out if isinstance(out, tuple) else (out,)))
    if kind == "eagle3":  # the head reads the prompts in graphs of its own, one per bucket of the target's
        assert scheduler.engine.target_prefill.head_graphs.keys() == scheduler.engine.target_prefill.graphs.keys()
    done = {}
    for i, prompt in enumerate(prompts):  # more requests than rows: they join as rows free up
        scheduler.submit(Request(prompt, params, on_done=lambda r, i=i: done.__setitem__(i, r.tokens)))
    scheduler.drain()
    assert [done[i] for i in range(len(prompts))] == expected


def test_compiled_step_graphs_speculative_equals_plain(tiny_models, kind, head_dir):
    prompts = random_prompts(8, 97, seed=5)
    e = engine(tiny_models, torch.float32, 4, True, compile_blocks=True, kind=kind, head_dir=head_dir)
    plain = outputs(e, prompts, 0, 4)
    assert outputs(e, prompts, 3, 4) == plain
    sampled = e.generate(prompts[:4], SamplingParams(temperature=0.8, max_new_tokens=16, seed=0), num_speculative_tokens=3)
    assert all(len(c.tokens) == 16 for c in sampled.completions)  # sampled rows take the forward-by-forward path


def test_a_dropped_engine_frees_its_graphs_at_once_and_a_later_capture_succeeds(tiny_models, kind, head_dir):
    # the evaluate stage makes an engine per proposer on one target: a dropped engine held in a reference
    # cycle kept its graphs until a garbage collection, which, coming during the next engine's capture,
    # reset them on the capturing stream and invalidated that capture
    import gc
    import weakref

    first = engine(tiny_models, torch.float32, 4, True, kind=kind, head_dir=head_dir)
    first.time_steps(4, [2])
    assert first.step_graphs.graphs
    dropped = weakref.ref(first)
    gc.disable()
    try:
        del first
        assert dropped() is None  # freed by its reference count, with no collection
    finally:
        gc.enable()
    second = engine(tiny_models, torch.float32, 4, True, kind=kind, head_dir=head_dir)
    assert second.time_steps(4, [3])[3] > 0 and (4, 3, "draft") in second.step_graphs.graphs


def test_graphed_engines_over_the_same_models_run_in_turns(tiny_models, kind, head_dir):
    # each engine's graphs were captured on its own caches: it takes them back before it runs
    prompts, params = random_prompts(8, 97, seed=5), SamplingParams(max_new_tokens=24)
    target_dir, draft_dir = tiny_models["smollm2"]
    target = load_model(target_dir, torch.float64, "cuda")
    draft = load_head(head_dir, torch.float64, "cuda") if kind == "eagle3" else load_model(draft_dir, torch.float64, "cuda")
    expected = outputs(engine(tiny_models, torch.float64, 4, False), prompts, 0, 4, params)
    plain = Engine(target, None, max_batch_size=4, max_seq_len=96, compile_blocks=False)
    assert outputs(plain, prompts, 0, 4, params) == expected  # plain's graphs captured before the next engine
    speculative = Engine(target, draft, max_batch_size=4, max_seq_len=80, compile_blocks=False)
    for _ in range(2):
        assert outputs(speculative, prompts, 3, 4, params) == expected
        assert outputs(plain, prompts, 0, 4, params) == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize("family", ["smollm2", "mistral", "gemma2", "gemma3"])
def test_decode_attention_kernel_matches_torch_attention(tiny_models, dtype, splits, family, monkeypatch):
    # the target's logits over 1, 3 and 6 tokens a row after 40-token prompts in cache rows 2, 0, 3, with
    # the triton kernel (its 97 slots in 1 or 2 parts) and with torch's attention; a fourth, padding row
    # (positions past the cache's end) sees less with the kernel, and only has to stay finite. Mistral and
    # Gemma: sliding windows (16, 8) shorter than the prompts; Gemma 2 soft-caps its scores; Gemma scales q
    from draftsmith.serve import decode_attention, model

    monkeypatch.setattr(decode_attention, "MIN_SPLIT_BLOCKS", 4 if splits == 1 else 1)
    assert decode_attention.num_splits(4, 2, 97) == splits
    target = load_model(tiny_models[family][0], dtype, "cuda")
    heads = target.args.num_heads
    assert decode_attention.runs(torch.zeros(4, 6, heads, target.args.head_dim, dtype=dtype, device="cuda"), 2)  # they take it
    target.setup_cache(4, 96)
    g = torch.Generator().manual_seed(0)
    rows = torch.tensor([2, 0, 3, 1], device="cuda")
    prompts = torch.randint(0, 97, (4, 40), generator=g).cuda()
    steps = [torch.randint(0, 97, (4, t), generator=g).cuda() for t in (1, 3, 6)]
    logits = {}
    for kernel in (False, True):
        monkeypatch.setattr(model, "USE_DECODE_ATTENTION", kernel)
        target(prompts, torch.arange(40, device="cuda").expand(4, 40), cache_rows=rows)
        outs = []
        for tokens in steps:
            t = tokens.shape[1]
            positions = torch.arange(40, 40 + t, device="cuda").expand(4, t).clone()
            positions[3] = 96 + torch.arange(t)  # padding
            outs.append(target(tokens, positions, cache_rows=rows).float())
        logits[kernel] = outs
    for torch_attention, kernel in zip(logits[False], logits[True]):
        scale = torch_attention[:3].abs().max()
        assert (kernel[:3] - torch_attention[:3]).abs().max() <= (1e-5 if dtype == torch.float32 else 0.03) * scale
        assert kernel[3].isfinite().all()


@pytest.mark.parametrize("family", ["smollm2", "gemma2"])
def test_the_gemv_kernel_decodes_as_plain_decoding_does(tiny_models, family, monkeypatch):
    # serve/gemv.py for one sequence's products (model.USE_GEMV): torch's products in float32, and in bfloat16 within
    # rounding, each row of a product over 8 rows bit for bit that row's product alone; the target's logits torch's
    # within rounding; then a compiled, graphed engine at batch 1, plain steps and verifications through the kernel,
    # gives greedy speculative output equal to its plain output in bfloat16 (where a kernel for plain steps beside
    # another for verifications parted from it) and in float32
    from draftsmith.serve import gemv, model

    monkeypatch.setattr(gemv, "MIN_WEIGHT", 0)  # the tiny models' weights too
    w, x = (torch.randn(*shape, device="cuda") for shape in ((1000, 576), (1, 8, 576)))
    torch.testing.assert_close(gemv.gemv(x, w), torch.nn.functional.linear(x, w), rtol=1e-4, atol=1e-4)  # float32 in full
    w, x = w.bfloat16(), x.bfloat16()
    rows = gemv.gemv(x, w)
    assert (rows.float() - torch.nn.functional.linear(x, w).float()).abs().max() <= 0.02 * rows.float().abs().max()
    assert all(torch.equal(gemv.gemv(x[:, j : j + 1], w), rows[:, j : j + 1]) for j in range(8))
    target_dir, draft_dir = tiny_models[family]
    target = load_model(target_dir, torch.bfloat16, "cuda")
    assert gemv.runs(torch.zeros(1, 1, target.args.hidden_size, dtype=torch.bfloat16, device="cuda"), target.output.weight)
    target.setup_cache(1, 96)
    prompt = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(0)).cuda()
    logits = {}
    for kernel in (False, True):
        monkeypatch.setattr(model, "USE_GEMV", kernel)
        target(prompt, torch.arange(40, device="cuda")[None])
        logits[kernel] = [target(prompt[:, :t], torch.arange(40, 40 + t, device="cuda")[None]).float() for t in (1, 4)]
    for torch_products, kernel in zip(logits[False], logits[True]):
        assert (kernel - torch_products).abs().max() <= 0.03 * torch_products.abs().max()
    prompts = random_prompts(8, 97, seed=5)
    params = SamplingParams(max_new_tokens=24)
    monkeypatch.setattr(model, "USE_GEMV", True)
    for dtype in (torch.bfloat16, torch.float32):
        target, draft = load_model(target_dir, dtype, "cuda"), load_model(draft_dir, dtype, "cuda")
        compiled = Engine(target, draft, max_batch_size=1, max_seq_len=96, compile_blocks=True)
        plain = outputs(compiled, prompts, 0, 1, params)
        assert outputs(compiled, prompts, 3, 1, params) == plain, f"{family}, {dtype}"


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_decodes_speculatively_as_plainly_under_graphs_and_compile(tiny_models, family):
    # compiled blocks, whole-step graphs and the decode kernel (sliding windows, soft-capping, partial rotary,
    # q/k norms): greedy speculative output equals plain greedy output of the same compiled model, and both
    # equal eager decoding (torch's attention) on most prompts (float32 rounding differs between them)
    target_dir, draft_dir = tiny_models[family]
    prompts = random_prompts(12, 97, seed=5)
    params = SamplingParams(max_new_tokens=24)
    target, draft = load_model(target_dir, torch.float32, "cuda"), load_model(draft_dir, torch.float32, "cuda")
    compiled = Engine(target, draft, max_batch_size=4, max_seq_len=96, compile_blocks=True)
    plain = outputs(compiled, prompts, 0, 4, params)
    for k in (1, 3):
        assert outputs(compiled, prompts, k, 4, params) == plain, f"{family}, K={k}"
    eager = Engine(target, draft, max_batch_size=4, max_seq_len=96, cuda_graphs=False, compile_blocks=False)
    assert sum(a == b for a, b in zip(outputs(eager, prompts, 0, 4, params), plain)) >= 10
