"""The runtime's model code against transformers on the same weights."""

import pytest
import torch

from draftsmith.serve.model import ModelArgs, UnsupportedModelError
from draftsmith.serve.weights import WeightsError, load_model
from tests.conftest import FAMILIES


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 0.15)])
def test_logits_match_transformers(tiny_models, family, dtype, tol):
    from transformers import AutoModelForCausalLM

    target_dir, _ = tiny_models[family]
    # Gemma 2 against transformers' eager attention: its sdpa path leaves out the attention scores' soft-capping
    implementation = {"attn_implementation": "eager"} if family == "gemma2" else {}
    reference = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype, **implementation).eval()
    ours = load_model(target_dir, dtype)
    ours.setup_cache(max_batch_size=2, max_seq_len=128)
    tokens = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(tokens).logits.float()
        prefill = ours(tokens, torch.arange(40).expand(2, 40)).float()
        # the same sequence fed one token at a time through the KV cache gives the same logits
        ours.setup_cache(max_batch_size=2, max_seq_len=128)
        stepwise = torch.cat([ours(tokens[:, i : i + 1], torch.full((2, 1), i)) for i in range(40)], dim=1).float()
    assert (prefill - expected).abs().max().item() < tol
    assert (stepwise - expected).abs().max().item() < tol


def test_rows_at_different_offsets_match_separate_runs(tiny_models):
    target_dir, _ = tiny_models["qwen2"]
    model = load_model(target_dir, torch.float64)
    model.setup_cache(max_batch_size=2, max_seq_len=64)
    a, b = torch.randint(0, 97, (1, 12)), torch.randint(0, 97, (1, 5))
    with torch.no_grad():
        alone_b = model(b, torch.arange(5)[None])[0, -1].clone()
        model.setup_cache(max_batch_size=2, max_seq_len=64)
        padded = torch.cat([a, torch.cat([b, torch.zeros(1, 7, dtype=torch.long)], 1)])
        together = model(padded, torch.arange(12).expand(2, 12))
    assert torch.allclose(together[1, 4], alone_b, atol=1e-10)


def test_unsupported_model_type_is_refused():
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        ModelArgs.from_hf_config({"model_type": "gpt2"})


def test_pickled_weights_are_refused(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(WeightsError, match="never loads pickles"):
        load_model(tmp_path)


def test_a_model_that_cannot_fit_is_refused_before_loading(tiny_models):
    from draftsmith.serve.weights import check_fits, weight_bytes

    target_dir, _ = tiny_models["llama"]
    from transformers import AutoModelForCausalLM

    params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(target_dir).state_dict().values())
    assert weight_bytes(target_dir, torch.bfloat16) == 2 * params and weight_bytes(target_dir, torch.float32) == 4 * params
    check_fits(target_dir, torch.bfloat16, "cpu", free=2 * params)
    with pytest.raises(WeightsError, match=r"does not fit: its weights take 0\.0 GiB in bfloat16 and cpu has 0\.0 GiB free"):
        check_fits(target_dir, torch.bfloat16, "cpu", free=2 * params - 1)
    check_fits(target_dir, torch.float32, "cpu")  # this machine's own available memory


@pytest.mark.parametrize("heads, kv_heads, tokens", [(6, 2, 1), (6, 2, 4), (4, 4, 3)])
def test_folded_attention_equals_sdpa(heads, kv_heads, tokens):
    # the CPU's attention over several query tokens: each row's queries at its own positions over a cache
    import torch.nn.functional as F

    from draftsmith.serve.model import folded_attention

    torch.manual_seed(0)
    B, S, D = 3, 24, 16
    q = torch.randn(B, heads, tokens, D, dtype=torch.float64)
    keys, values = torch.randn(B, kv_heads, S, D, dtype=torch.float64), torch.randn(B, kv_heads, S, D, dtype=torch.float64)
    positions = torch.tensor([[2], [9], [20]]) + torch.arange(tokens)  # [B, T]
    mask = torch.arange(S).view(1, 1, 1, S) <= positions.view(B, 1, tokens, 1)
    for scale in (D**-0.5, 0.2):  # the default scaling and Gemma's query_pre_attn_scalar^-0.5
        expected = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=heads != kv_heads)
        torch.testing.assert_close(folded_attention(q, keys, values, mask, scale), expected, rtol=0, atol=1e-12)


def test_the_compute_dtype_is_bf16_on_a_cpu_only_where_it_multiplies_in_bf16(monkeypatch):
    from draftsmith.serve import device as engine

    assert engine.compute_dtype("float16", "cuda") == torch.float16
    assert engine.compute_dtype("float32", "cpu") == engine.compute_dtype("float16", "cpu") == torch.float32
    for native, expected in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: native)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
        assert engine.cpu_has_bf16() is native and engine.compute_dtype("bfloat16", "cpu") == expected


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_output_equals_transformers_token_for_token(tiny_models, family):
    # float32; prompts of different lengths batched (each row at its own offset), and one alone; 30 new tokens
    # take every sliding window (8 and 16 slots) past its end
    from transformers import AutoModelForCausalLM

    from draftsmith.serve.engine import Engine
    from draftsmith.serve.sampling import SamplingParams

    target_dir, _ = tiny_models[family]
    implementation = {"attn_implementation": "eager"} if family == "gemma2" else {}
    reference = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32, **implementation).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (5, 12, 3, 9)]
    expected = []
    for prompt in prompts:
        with torch.no_grad():
            out = reference.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False, eos_token_id=None, pad_token_id=0)
        expected.append(out[0, len(prompt) :].tolist())
    engine = Engine(load_model(target_dir, torch.float32), None, max_batch_size=4, max_seq_len=64)
    params = SamplingParams(max_new_tokens=30)
    assert [c.tokens for c in engine.generate(prompts, params).completions] == expected
    assert engine.generate(prompts[1:2], params).completions[0].tokens == expected[1]


def test_a_family_the_runtime_does_not_implement_decodes_through_transformers(tmp_path):
    # target.fallback=transformers: Granite (multipliers on embeddings, residuals, attention and logits) behind the
    # runtime's model interface decodes as transformers' generate does, batched and alone, plainly and
    # speculatively with a draft of its own first layer and with an EAGLE-3 head, on the same engine code
    from transformers import AutoModelForCausalLM

    from draftsmith.serve.engine import Engine, load_draft
    from draftsmith.serve.model import UnsupportedModelError
    from draftsmith.serve.sampling import SamplingParams
    from draftsmith.serve.transformers_model import TransformersModel, load_any
    from tests.conftest import save_tiny_head, save_tiny_model, save_truncated_draft

    target_dir = save_tiny_model(tmp_path / "granite", "granite", seed=5)
    draft_dir = save_truncated_draft(target_dir, tmp_path / "draft", keep_layers=1)
    with pytest.raises(UnsupportedModelError, match="granite"):
        load_model(target_dir, torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (5, 12, 3, 9)]
    expected = []
    for prompt in prompts:
        with torch.no_grad():
            out = reference.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)
        expected.append(out[0, len(prompt) :].tolist())
    target = load_any(target_dir, torch.float32, "cpu")
    assert isinstance(target, TransformersModel)
    params = SamplingParams(max_new_tokens=20)
    plain = Engine(target, None, max_batch_size=4, max_seq_len=64)
    assert [c.tokens for c in plain.generate(prompts, params).completions] == expected
    assert plain.generate(prompts[1:2], params).completions[0].tokens == expected[1]
    head = load_draft(save_tiny_head(target_dir, tmp_path / "head", seed=1), torch.float32, "cpu")
    for draft in (load_draft(draft_dir, torch.float32, "cpu", fallback=True), head):
        speculative = Engine(target, draft, max_batch_size=4, max_seq_len=64)
        for k in (1, 3):
            got = speculative.generate(prompts, params, num_speculative_tokens=k)
            assert [c.tokens for c in got.completions] == expected, f"{type(draft).__name__}, K={k}"
    assert got.stats.num_drafts > 0
