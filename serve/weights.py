"""Loading HF safetensors model dirs into the runtime's Transformer (no transformers needed)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor

from draftsmith.serve.compressed import dequantize
from draftsmith.serve.model import ModelArgs, Transformer


class WeightsError(ValueError):
    """A model dir's weights are missing, pickled, or do not match its config."""


def read_config(path: Path) -> dict:
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise WeightsError(f"{path} is not an HF model dir: it has no config.json")
    return json.loads(config_file.read_text())


def read_safetensors(path: Path) -> dict[str, Tensor]:
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        pickled = [p.name for p in Path(path).glob("*.bin")] + [p.name for p in Path(path).glob("*.pt")]
        hint = f" (found {', '.join(pickled)}: draftsmith never loads pickles; re-save with safe_serialization)" if pickled else ""
        raise WeightsError(f"{path} has no *.safetensors weights{hint}")
    tensors: dict[str, Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    return tensors


def weight_bytes(path: Path, dtype: torch.dtype) -> int:
    """The bytes a model dir's weights take in `dtype`, from the safetensors headers (nothing loaded)."""
    count = 0
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            count += sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    return count * dtype.itemsize


def free_bytes(device: str | torch.device) -> int:
    """Memory free for weights: the GPU's free memory, or the host's available memory on CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    meminfo = Path("/proc/meminfo")
    for line in meminfo.read_text().splitlines() if meminfo.is_file() else ():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_fits(path: str | Path, dtype: torch.dtype, device: str | torch.device, free: int | None = None, shards: int = 1) -> None:
    """Refuse, before loading, a model whose weights alone (split `shards` ways: tensor parallelism)
    exceed what `device` has free."""
    need, free = weight_bytes(Path(path), dtype), free_bytes(device) if free is None else free
    if need / shards > free:
        gib = 2**30
        split = f", {need / shards / gib:.1f} GiB on each of {shards} devices," if shards > 1 else ""
        raise WeightsError(
            f"{path} does not fit: its weights take {need / gib:.1f} GiB in {str(dtype).removeprefix('torch.')}"
            f"{split} and {device} has {free / gib:.1f} GiB free. Use a device with more memory, a smaller "
            f"target, or more devices: distill.teacher.tensor_parallel splits the target across a torchrun "
            f"launch's processes for the teacher stage, and distillation from its logit cache needs no target"
        )


def fused(take, prefix: str, parts: tuple[str, ...], fused_name: str, suffix: str = "weight") -> Tensor:
    """A fused projection: stored fused (Phi-3's qkv_proj, gate_up_proj) or as its parts, concatenated."""
    try:
        return take(f"{prefix}{fused_name}.{suffix}")
    except WeightsError:
        return torch.cat([take(f"{prefix}{part}.{suffix}") for part in parts])


def to_runtime_state(hf: dict[str, Tensor], args: ModelArgs) -> dict[str, Tensor]:
    """Rename HF tensors to the runtime's and fuse q/k/v and gate/up projections."""

    def take(name: str) -> Tensor:
        try:
            return hf[name]
        except KeyError:
            raise WeightsError(f"tensor {name!r} is missing from the checkpoint") from None

    state = {"tok_embeddings.weight": take("model.embed_tokens.weight"), "norm.weight": take("model.norm.weight")}
    state["output.weight"] = (
        hf.get("lm_head.weight", state["tok_embeddings.weight"]) if args.tie_word_embeddings else take("lm_head.weight")
    )
    # Gemma: post_attention_layernorm is the attention output's norm, pre_feedforward_layernorm the MLP's input's
    norms = {"attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
    if args.sandwich_norm:
        norms.update(
            ffn_norm="pre_feedforward_layernorm", post_attention_norm="post_attention_layernorm", post_ffn_norm="post_feedforward_layernorm"
        )
    qkv, gate_up = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj")
    for i in range(args.num_layers):
        p, q = f"model.layers.{i}.", f"layers.{i}."
        state.update({f"{q}{ours}.weight": take(f"{p}{theirs}.weight") for ours, theirs in norms.items()})
        state[q + "attention.wqkv.weight"] = fused(take, p, qkv, "self_attn.qkv_proj")
        if args.qkv_bias:
            state[q + "attention.wqkv.bias"] = fused(take, p, qkv, "self_attn.qkv_proj", "bias")
        state[q + "attention.wo.weight"] = take(p + "self_attn.o_proj.weight")
        if args.qk_norm:
            state[q + "attention.q_norm.weight"] = take(p + "self_attn.q_norm.weight")
            state[q + "attention.k_norm.weight"] = take(p + "self_attn.k_norm.weight")
        if args.o_bias:
            state[q + "attention.wo.bias"] = take(p + "self_attn.o_proj.bias")
        state[q + "feed_forward.w13.weight"] = fused(take, p, gate_up, "mlp.gate_up_proj")
        state[q + "feed_forward.w2.weight"] = take(p + "mlp.down_proj.weight")
        if args.mlp_bias:
            state[q + "feed_forward.w13.bias"] = fused(take, p, gate_up, "mlp.gate_up_proj", "bias")
            state[q + "feed_forward.w2.bias"] = take(p + "mlp.down_proj.bias")
    return state


def load_model(path: str | Path, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu") -> Transformer:
    """Build the runtime model of an HF dir, weights in `dtype` on `device`, in eval mode.

    A compressed-tensors W4A16 / W8A16 checkpoint (the quantized draft) is dequantized at load."""
    config = read_config(Path(path))
    if "quantization_config" not in config:  # packed weights grow at load; they are drafts, small anyway
        check_fits(path, dtype, device)
    hf_state = read_safetensors(Path(path))
    if "quantization_config" in config:
        hf_state = dequantize(hf_state, config["quantization_config"], dtype)
    args = ModelArgs.from_hf_config(config)
    state = to_runtime_state(hf_state, args)
    with torch.device("meta"):
        model = Transformer(args)
    state = {k: v.to(device=device, dtype=dtype) for k, v in state.items()}
    if args.tie_word_embeddings:
        state.pop("output.weight")
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if args.tie_word_embeddings:
        model.output.weight = model.tok_embeddings.weight
        missing = [m for m in missing if m != "output.weight"]
    if missing or unexpected:
        raise WeightsError(f"{path}: weights do not match config.json (missing {missing[:5]}, unexpected {unexpected[:5]})")
    return model.eval()
