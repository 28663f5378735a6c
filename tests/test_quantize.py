"""AWQ of a tiny draft on CPU: compressed-tensors output that transformers and the runtime both load,
the group-size choice, the int4 unpacking, and the guards that refuse the target and < 4 bits."""

import json
import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from draftsmith.distill.tokenizer import check_same_tokenizer, copy_tokenizer_files
from draftsmith.quantize.awq import QuantizeError, choose_group_size, quantize_awq
from draftsmith.serve.compressed import unpack_int32
from draftsmith.serve.weights import load_model
from tests.conftest import save_truncated_draft


@pytest.fixture(scope="module")
def tiny_draft(tiny_chat_target, tmp_path_factory):
    path = save_truncated_draft(tiny_chat_target, tmp_path_factory.mktemp("q") / "draft", keep_layers=2)
    copy_tokenizer_files(tiny_chat_target, path)
    return path


def calibration(n: int = 16, length: int = 48) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 49152, (length,), generator=g).tolist() for _ in range(n)]


@pytest.fixture(scope="module")
def w4a16(tiny_draft, tiny_chat_target, tmp_path_factory):
    out = tmp_path_factory.mktemp("q") / "w4a16"
    done = quantize_awq(tiny_draft, tiny_chat_target, out, calibration(), bits=4, group_size=None, ignore=["lm_head"])
    copy_tokenizer_files(tiny_chat_target, out)
    return out, done


@pytest.fixture(scope="module")
def nearest(tiny_draft, tiny_chat_target, tmp_path_factory):
    """The same draft with each weight rounded to its nearest int4 level instead of by GPTQ (the default)."""
    out = tmp_path_factory.mktemp("q") / "nearest"
    quantize_awq(tiny_draft, tiny_chat_target, out, calibration(), bits=4, group_size=None, ignore=["lm_head"], rounding="nearest")
    copy_tokenizer_files(tiny_chat_target, out)
    return out


def test_w4a16_checkpoint_is_compressed_tensors_with_the_target_tokenizer(w4a16, tiny_chat_target):
    from draftsmith.quantize.stage import tensor_sizes

    out, done = w4a16
    dtypes = {dtype for dtype, _ in tensor_sizes(out).values()}
    assert "BF16" in dtypes and not dtypes & {"F32", "F16", "F64"}, dtypes  # calibrated in float32, shipped in bf16
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors" and config["format"] == "pack-quantized"
    weights = config["config_groups"]["group_0"]["weights"]
    assert (weights["num_bits"], weights["symmetric"], weights["strategy"]) == (4, False, "group")
    assert weights["group_size"] == done["group_size"] == 32  # hidden 96: 128 and 64 do not divide it
    assert config["ignore"] == [r"re:(.*\.)?lm_head$"]  # a pattern: vLLM builds the draft under its own prefix
    check_same_tokenizer(tiny_chat_target, out)


def test_transformers_and_the_runtime_load_w4a16_and_agree(w4a16, tiny_draft):
    from transformers import AutoModelForCausalLM

    out, _ = w4a16
    tokens = torch.randint(3, 49152, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()(tokens).logits
        dense = AutoModelForCausalLM.from_pretrained(tiny_draft, dtype=torch.float32).eval()(tokens).logits
        ours = load_model(out, torch.float32)
        ours.setup_cache(max_batch_size=2, max_seq_len=64)
        runtime = ours(tokens, torch.arange(24).expand(2, 24))
    # the same int4 weights dequantized twice: equal up to float32 rounding
    assert (runtime - reference).abs().max().item() < 1e-4 * reference.abs().max().item() + 1e-4
    # and int4 error against the dense draft: visible, yet well under the logits' spread (random
    # weights have no salient channels for AWQ to protect, so this is int4's worst case)
    error = (reference - dense).abs().mean() / dense.std()
    assert 1e-3 < error.item() < 0.5, error.item()


def test_layers_left_unquantized_keep_their_weights_and_the_rest_is_still_awq(tiny_draft, tiny_chat_target, tmp_path):
    """quantize.ignore may name any linear layer, AWQ balance layers included (llm-compressor divided by
    zero when a smoothing pair had no quantized layer left): those stay dense and untouched."""
    out = tmp_path / "mixed"
    quantize_awq(tiny_draft, tiny_chat_target, out, calibration(), bits=4, group_size=None, ignore=["lm_head", "re:.*down_proj$"])
    copy_tokenizer_files(tiny_chat_target, out)
    dense, mixed = load_model(tiny_draft, torch.float32), load_model(out, torch.float32)
    for before, after in zip(dense.layers, mixed.layers):
        assert torch.equal(after.feed_forward.w2.weight, before.feed_forward.w2.weight.bfloat16().float())  # shipped in bf16
        assert not torch.equal(after.feed_forward.w13.weight, before.feed_forward.w13.weight.bfloat16().float())


@settings(max_examples=50, deadline=None)
@given(bits=st.sampled_from([4, 8]), rows=st.integers(1, 5), cols=st.integers(1, 40), seed=st.integers(0, 10**6))
def test_unpack_inverts_compressed_tensors_packing(bits, rows, cols, seed):
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    low, high = -(1 << (bits - 1)), (1 << (bits - 1))
    values = torch.randint(low, high, (rows, cols), generator=torch.Generator().manual_seed(seed), dtype=torch.int8)
    packed = pack_to_int32(values, bits)
    assert torch.equal(unpack_int32(packed, bits, cols), values.to(torch.int32))
    along_rows = pack_to_int32(values, bits, packed_dim=0)  # how zero points are packed
    assert torch.equal(unpack_int32(along_rows.T.contiguous(), bits, rows).T, values.to(torch.int32))


def test_group_size_is_the_largest_that_divides_every_in_features():
    assert choose_group_size([4096, 4096, 11008]) == 128
    assert choose_group_size([576, 576, 1536]) == 64  # SmolLM2
    assert choose_group_size([96, 96, 128]) == 32
    assert choose_group_size([576, 576, 1536], requested=32) == 32
    with pytest.raises(QuantizeError, match="no group size"):
        choose_group_size([100])


def test_quantizing_the_target_is_refused_even_from_a_copy(tiny_chat_target, tmp_path):
    with pytest.raises(QuantizeError, match="refusing to quantize the target.*distort the acceptance test"):
        quantize_awq(tiny_chat_target, tiny_chat_target, tmp_path / "out", calibration(), bits=4, group_size=None, ignore=[])
    copy = shutil.copytree(tiny_chat_target, tmp_path / "renamed")
    with pytest.raises(QuantizeError, match="refusing to quantize the target"):
        quantize_awq(copy, tiny_chat_target, tmp_path / "out", calibration(), bits=4, group_size=None, ignore=[])
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("bits", [2, 3])
def test_fewer_than_four_bits_is_refused(tiny_draft, tiny_chat_target, tmp_path, bits):
    with pytest.raises(QuantizeError, match="fewer than 4 bits is refused.*acceptance collapses"):
        quantize_awq(tiny_draft, tiny_chat_target, tmp_path / "out", calibration(), bits=bits, group_size=None, ignore=[])
    assert not (tmp_path / "out").exists()


def test_a_checkpoint_saved_with_float32_tensors_ships_them_in_bf16(w4a16, tmp_path):
    # what llm-compressor saved on the H200 after a float32 calibration: an offloaded float32 embedding
    from safetensors.torch import load_file, save_file

    from draftsmith.quantize.awq import ship_in_bf16

    out, _ = w4a16
    saved = load_file(out / "model.safetensors")
    wide = {name: t.float() if t.is_floating_point() else t for name, t in saved.items()}
    save_file(wide, tmp_path / "model.safetensors", metadata={"format": "pt"})
    ship_in_bf16(tmp_path)
    shipped = load_file(tmp_path / "model.safetensors")
    assert shipped.keys() == saved.keys()
    assert all(shipped[n].dtype == saved[n].dtype and torch.equal(shipped[n], saved[n]) for n in saved)


def test_scales_are_searched_in_the_calibration_dtype(w4a16, tiny_draft, tiny_chat_target, tmp_path):
    # float32 by default on every device (bf16 calibration on the H200 cost 7.6-8.9% held-out TVD, float32
    # on the CPU 0.6%): the same draft and data calibrated in bf16 give other scales, so the setting is used
    from safetensors.torch import load_file

    out, done = w4a16
    assert done["calibration_dtype"] == "float32"
    bf16 = quantize_awq(
        tiny_draft,
        tiny_chat_target,
        tmp_path / "bf16",
        calibration(),
        bits=4,
        group_size=None,
        ignore=["lm_head"],
        calibration_dtype="bfloat16",
    )
    assert bf16["calibration_dtype"] == "bfloat16"
    ours, theirs = load_file(out / "model.safetensors"), load_file(tmp_path / "bf16" / "model.safetensors")
    scales = [name for name in ours if name.endswith("weight_scale")]
    assert scales and ours.keys() == theirs.keys()
    assert any(not torch.equal(ours[name], theirs[name]) for name in scales)


def test_the_mse_observer_rounds_each_group_closer_than_minmax(w4a16, nearest, tiny_draft, tiny_chat_target, tmp_path):
    # AWQ's scale search is the same either way (it rounds with min-max while searching), so both checkpoints
    # hold the same smoothed weights W * s (s folded out of the norm before each layer); the mse observer then
    # clips each group's range where its rounding error is least, which min-max (no clipping) never beats when
    # each weight is rounded to its nearest level (GPTQ trades weight error for output error)
    from draftsmith.serve.compressed import dequantize
    from draftsmith.serve.weights import read_config, read_safetensors

    assert w4a16[1]["observer"] == "mse"  # the default
    assert (
        quantize_awq(
            tiny_draft,
            tiny_chat_target,
            tmp_path / "minmax",
            calibration(),
            bits=4,
            group_size=None,
            ignore=["lm_head"],
            observer="minmax",
            rounding="nearest",
        )["observer"]
        == "minmax"
    )
    load = lambda path: dequantize(read_safetensors(path), read_config(path)["quantization_config"], torch.float32)
    dense, minmax, clipped = read_safetensors(tiny_draft), load(tmp_path / "minmax"), load(nearest)
    errors = {"minmax": 0.0, "mse": 0.0}
    for i in range(2):
        for norm, linears in (
            ("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
            ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
        ):
            at = f"model.layers.{i}."
            torch.testing.assert_close(minmax[at + norm + ".weight"], clipped[at + norm + ".weight"])
            s = dense[at + norm + ".weight"] / minmax[at + norm + ".weight"]
            for linear in linears:
                smoothed = dense[at + linear + ".weight"] * s
                for name, model in (("minmax", minmax), ("mse", clipped)):
                    errors[name] += (model[at + linear + ".weight"] - smoothed).pow(2).sum().item()
    assert errors["mse"] < errors["minmax"], errors


def test_gptq_rounding_follows_the_dense_draft_closer_than_rounding_to_nearest(w4a16, nearest, tiny_draft):
    # quantize.rounding=gptq (the default): after the same AWQ scales, GPTQ rounds column by column and makes up
    # each rounding's error on the calibration activations with the columns not yet rounded, so the quantized
    # draft's outputs on that data stay closer to the dense draft's than with each weight rounded to its nearest level
    from transformers import AutoModelForCausalLM

    from draftsmith.serve.compressed import dequantize
    from draftsmith.serve.weights import read_config, read_safetensors

    gptq, done = w4a16
    assert done["rounding"] == "gptq"  # the default
    to_nearest, rounded = (dequantize(read_safetensors(p), read_config(p)["quantization_config"], torch.float32) for p in (nearest, gptq))
    norms = [name for name in to_nearest if name.endswith("layernorm.weight")]
    assert norms and all(torch.equal(to_nearest[n], rounded[n]) for n in norms)  # the same AWQ scales
    linears = [n for n in to_nearest if n.endswith("proj.weight")]
    assert any(not torch.equal(to_nearest[n], rounded[n]) for n in linears)

    tokens = torch.tensor(calibration())
    logits = lambda path: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()(tokens).logits
    with torch.no_grad():
        reference = logits(tiny_draft)
        errors = {name: (logits(path) - reference).pow(2).mean().item() for name, path in (("nearest", nearest), ("gptq", gptq))}
    assert errors["gptq"] < errors["nearest"], errors  # 0.29 against 0.35


def test_ignored_layers_match_under_any_prefix_a_loader_builds_the_draft_with(tiny_draft, tiny_chat_target, tmp_path):
    """llm-compressor writes the layers it left dense by transformers' names (model.layers.0.mlp.down_proj);
    vLLM builds a draft under its own prefix (draft_model.model.layers...), and a bare name there matched
    nothing, so vLLM expected those layers packed and refused the bundle. Every entry is now a pattern."""
    import re

    from compressed_tensors.utils.match import match_name

    out = tmp_path / "w4a16"
    quantize_awq(tiny_draft, tiny_chat_target, out, calibration(), bits=4, group_size=None, ignore=["lm_head", "re:.*down_proj$"])
    ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    assert ignore and all(entry.startswith("re:") for entry in ignore), ignore
    matches = lambda name: any(re.match(entry.removeprefix("re:"), name) for entry in ignore)
    for prefix in ("", "model.", "draft_model.model.", "model.draft.model."):
        assert matches(f"{prefix}layers.1.mlp.down_proj") and matches(f"{prefix.removesuffix('model.')}lm_head")
        assert not matches(f"{prefix}layers.1.mlp.up_proj") and not matches(f"{prefix}layers.1.self_attn.q_proj")
    assert any(match_name("model.layers.0.mlp.down_proj", entry) for entry in ignore)  # compressed-tensors' own matching
    # and the dense layers are what both loaders find dense
    dense, mixed = load_model(tiny_draft, torch.float32), load_model(out, torch.float32)
    assert torch.equal(mixed.layers[1].feed_forward.w2.weight, dense.layers[1].feed_forward.w2.weight.bfloat16().float())


def test_portable_ignore_keeps_patterns_and_anchors_names():
    from draftsmith.quantize.awq import portable_ignore

    assert portable_ignore(["re:.*self_attn.*", "model.layers.1.mlp.down_proj", "lm_head", "lm_head"]) == [
        "re:.*self_attn.*",
        r"re:(.*\.)?layers\.1\.mlp\.down_proj$",
        r"re:(.*\.)?lm_head$",
    ]


@pytest.mark.parametrize("family", ["gemma2", "phi3", "qwen3"])
def test_awq_uses_each_familys_smoothing_pairs_and_both_loaders_agree(family, demo_target_dir, tmp_path):
    """Gemma's MLP input is its pre-feedforward norm and Phi-3's projections are fused: llm-compressor's pairs
    for the architecture, resolved layer by layer; the W4A16 draft then loads in transformers and the runtime alike."""
    from transformers import AutoModelForCausalLM

    from draftsmith.quantize.awq import awq_mappings
    from tests.conftest import save_tiny_model

    target = save_tiny_model(tmp_path / "target", family, seed=4, vocab_size=49152)
    copy_tokenizer_files(demo_target_dir, target)
    draft = save_truncated_draft(target, tmp_path / "draft", keep_layers=2)
    copy_tokenizer_files(demo_target_dir, draft)
    model = AutoModelForCausalLM.from_pretrained(draft)
    pairs = {
        (m.smooth_layer.split(".", 3)[-1], tuple(b.split(".", 3)[-1] for b in m.balance_layers))
        for m in awq_mappings(model, model.config.architectures[0], ["lm_head"])
    }
    expected = {
        "gemma2": ("pre_feedforward_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
        "phi3": ("input_layernorm", ("self_attn.qkv_proj",)),
        "qwen3": ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
    }[family]
    assert expected in pairs, pairs
    out = tmp_path / "w4a16"
    quantize_awq(draft, target, out, calibration(8, 32), bits=4, group_size=None, ignore=["lm_head"])
    tokens = torch.randint(3, 49152, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        implementation = {"attn_implementation": "eager"} if family == "gemma2" else {}
        reference = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, **implementation).eval()(tokens).logits
        ours = load_model(out, torch.float32)
        ours.setup_cache(max_batch_size=2, max_seq_len=32)
        runtime = ours(tokens, torch.arange(16).expand(2, 16))
    assert (runtime - reference).abs().max().item() < 1e-3 * reference.abs().max().item() + 1e-3
