"""AWQ of the draft through llm-compressor: W4A16 asymmetric, written as compressed-tensors.

The target is never quantized: speculative decoding is lossless only with respect to the model that
verifies, so quantization error in the target would change the outputs users get and distort the
acceptance test itself. Only the draft, whose errors cost acceptance and never correctness, is.
"""

from __future__ import annotations

import io
import json
import logging
import re
import sys
import warnings
from contextlib import contextmanager, redirect_stderr
from importlib import metadata
from pathlib import Path
from typing import Sequence

from draftsmith.pipeline.config import bits_refusal

GROUP_SIZES = (128, 64, 32)  # largest first: fewer scales, and vLLM's kernels prefer 128


class QuantizeError(ValueError):
    """A quantization request that draftsmith refuses, with the reason and the fix."""


@contextmanager
def quietly():
    """llm-compressor's and compressed-tensors' progress bars (they pass tqdm an explicit `disable`, so
    TQDM_DISABLE does not reach them), library warnings and log records below errors kept out of the user's
    log; what they wrote to stderr is shown only if the work inside fails."""
    captured = io.StringIO()
    logging.disable(logging.WARNING)  # torch's and the libraries' warnings through logging too
    try:
        with warnings.catch_warnings(), redirect_stderr(captured):
            warnings.simplefilter("ignore")
            yield
    except BaseException:
        sys.stderr.write(captured.getvalue()[-4000:])
        raise
    finally:
        logging.disable(logging.NOTSET)


def check_bits(bits: int) -> None:
    if (refused := bits_refusal(bits)) is not None:
        raise QuantizeError(refused)


def _weights_digest(model_dir: Path) -> list[str]:
    from draftsmith.pipeline.stage import sha256_file

    return [sha256_file(file) for file in sorted(model_dir.glob("*.safetensors"))]


def refuse_target(model_dir: Path, target_dir: Path) -> None:
    """Raise QuantizeError when `model_dir` is the target (same dir or same weights)."""
    same_dir = model_dir.resolve() == target_dir.resolve()
    if same_dir or _weights_digest(model_dir) == _weights_digest(target_dir):
        raise QuantizeError(
            f"refusing to quantize the target ({model_dir}): speculative decoding is lossless only "
            "with respect to the verifying model, so quantization error in the target would change "
            "the outputs and distort the acceptance test it relies on; quantize the draft instead"
        )


def linear_in_features(config: dict) -> list[int]:
    """in_features of every Linear that AWQ quantizes in a Llama-family decoder layer."""
    hidden, intermediate = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    return [hidden, heads * head_dim, intermediate]  # q/k/v and gate/up; o_proj; down_proj


def choose_group_size(in_features: Sequence[int], requested: int | None = None) -> int:
    """The requested group size, or the largest of 128, 64, 32 that divides every in_features."""
    for size in [requested] if requested else GROUP_SIZES:
        if all(n % size == 0 for n in in_features):
            return size
    raise QuantizeError(
        f"no group size in {[requested] if requested else GROUP_SIZES} divides every in_features "
        f"{sorted(set(in_features))}; set quantize.group_size to one that does"
    )


def _allow_cpu_calibration() -> None:
    """llm-compressor 0.14 pins calibration tensors in page-locked memory unconditionally, which raises
    "Cannot access accelerator device when none is available" without a GPU; pinning only helps
    host-to-GPU copies, so it is skipped when there is no GPU."""
    import torch

    if torch.cuda.is_available() or not metadata.version("llmcompressor").startswith("0.14."):
        return
    from llmcompressor.pipelines.cache import IntermediatesCache

    IntermediatesCache._pin_intermediate = classmethod(lambda cls, intermediate: None)


def ship_in_bf16(model_dir: Path) -> None:
    """Rewrite every floating tensor of the saved checkpoint in bf16: scales, norms and the embedding
    table. Casting the model before saving is not enough: on a GPU llm-compressor keeps offloaded copies
    in the calibration dtype, and those are what it saves (a float32 calibration on the H200 shipped a
    113 MB float32 embedding table)."""
    import torch
    from safetensors.torch import load_file, save_file

    for file in sorted(model_dir.glob("*.safetensors")):
        tensors = load_file(file)
        wide = {name for name, t in tensors.items() if t.is_floating_point() and t.dtype != torch.bfloat16}
        if wide:
            save_file({name: t.to(torch.bfloat16) if name in wide else t for name, t in tensors.items()}, file, metadata={"format": "pt"})


def portable_ignore(ignore: Sequence[str]) -> list[str]:
    """quantization_config.ignore entries that match a module under whatever prefix a loader builds it.

    llm-compressor writes the modules it left dense as transformers names them (`model.layers.0.mlp.down_proj`),
    but vLLM builds a draft under a prefix of its own (`draft_model.`...), so a bare name matches nothing
    there and vLLM expects that layer packed ("no module or parameter named 'layers.0.mlp.down_proj.weight'").
    Each bare name becomes a pattern for the name as a dotted suffix, without transformers' leading
    `model.`; patterns (`re:...`) stay as they are."""
    out = []
    for entry in ignore:
        pattern = entry if entry.startswith("re:") else r"re:(.*\.)?" + re.escape(entry.removeprefix("model.")) + "$"
        if pattern not in out:
            out.append(pattern)
    return out


def make_ignore_portable(model_dir: Path) -> None:
    """Rewrite the saved config.json's quantization_config.ignore with portable_ignore."""
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    quantization = config.get("quantization_config") or {}
    if quantization.get("ignore"):
        quantization["ignore"] = portable_ignore(quantization["ignore"])
        path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def awq_mappings(model, architecture: str, ignore: Sequence[str]) -> list:
    """AWQ's smoothing pairs of a decoder, layer by layer: llm-compressor's pairs for the architecture (its
    registry: Llama's by default, Gemma's pre-feedforward norm, Phi-3's fused projections), resolved to the
    model's module names, without the balance layers that `ignore` keeps unquantized: llm-compressor averages
    the quantized balance layers of a pair and divides by zero when a pair has none."""
    from compressed_tensors.utils.match import match_name
    from llmcompressor.modifiers.transform.awq import AWQMapping
    from llmcompressor.modifiers.transform.awq.mappings import AWQ_MAPPING_REGISTRY, default_mappings

    quantized = lambda name: not any(match_name(name, pattern) for pattern in ignore)
    names = [name for name, _ in model.named_modules()]
    layers = sorted({m.group(0) for name in names if (m := re.match(r".*?layers\.\d+\.", name))}, key=lambda p: int(p.split(".")[-2]))
    mappings = []
    for prefix in layers:
        inside = [name for name in names if name.startswith(prefix)]
        for pair in AWQ_MAPPING_REGISTRY.get(architecture, default_mappings):
            smooth = next((name for name in inside if match_name(name, pair.smooth_layer)), None)
            kept = [name for pattern in pair.balance_layers for name in inside if match_name(name, pattern) and quantized(name)]
            if smooth is not None and kept:
                mappings.append(AWQMapping(smooth, kept, pair.activation_hook_target))
    return mappings


def quantize_awq(
    draft_dir: Path,
    target_dir: Path,
    out_dir: Path,
    calibration: list[list[int]],
    *,
    bits: int,
    group_size: int | None,
    ignore: Sequence[str],
    calibration_dtype: str = "float32",
    observer: str = "mse",
    rounding: str = "gptq",
) -> dict:
    """AWQ-quantize the draft in `draft_dir` into `out_dir` (compressed-tensors), searching the scales with
    the draft in `calibration_dtype`, each weight group's range then set by `observer` (llm-compressor's:
    "minmax", or "mse", which clips the range where the rounding error is least) and its weights rounded by
    `rounding` ("gptq": llm-compressor's GPTQ on the same calibration data, or "nearest"); return what was done."""
    import torch
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_bits(bits)
    refuse_target(draft_dir, target_dir)
    if not calibration:
        raise QuantizeError("no calibration samples: AWQ needs the domain training split")
    config = json.loads((draft_dir / "config.json").read_text())
    group = choose_group_size(linear_in_features(config), group_size)
    _allow_cpu_calibration()
    model = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=getattr(torch, calibration_dtype))
    dataset = Dataset.from_list([{"input_ids": ids, "attention_mask": [1] * len(ids)} for ids in calibration])
    weights = QuantizationArgs(num_bits=bits, type="int", symmetric=False, strategy="group", group_size=group, observer=observer)
    rounder = GPTQModifier if rounding == "gptq" else QuantizationModifier
    recipe = [
        AWQModifier(duo_scaling=True, mappings=awq_mappings(model, (config.get("architectures") or ["?"])[0], ignore)),
        rounder(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights)}, ignore=list(ignore)),
    ]
    oneshot(
        model=model,
        processor=AutoTokenizer.from_pretrained(draft_dir),
        dataset=dataset,
        recipe=recipe,
        num_calibration_samples=len(calibration),
        max_seq_length=max(len(ids) for ids in calibration),
        shuffle_calibration_samples=False,
    )
    model.save_pretrained(out_dir, save_compressed=True)
    make_ignore_portable(out_dir)
    ship_in_bf16(out_dir)
    return {
        "bits": bits,
        "group_size": group,
        "ignore": list(ignore),
        "scheme": f"W{bits}A16 asymmetric",
        "num_calibration_samples": len(calibration),
        "calibration_dtype": calibration_dtype,
        "observer": observer,
        "rounding": rounding,
    }
