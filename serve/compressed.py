"""Reading compressed-tensors `pack-quantized` checkpoints (the W4A16 draft) as dense weights.

Format facts (compressed-tensors 0.19): a quantized Linear `X` is stored as
  X.weight_packed      int32 [out, ceil(in * bits / 32)]  values q + 2^(bits-1), little end first
  X.weight_scale       [out, in / group]
  X.weight_zero_point  int32 [ceil(out * bits / 32), in / group]  packed the same way along dim 0
  X.weight_shape       int64 [2] = (out, in)
and w = (q - zero_point) * scale per group of `group` input columns.
"""

from __future__ import annotations

import torch
from torch import Tensor


class CompressedFormatError(ValueError):
    """A quantization_config this runtime cannot read."""


def unpack_int32(packed: Tensor, bits: int, count: int) -> Tensor:
    """[rows, words] int32 -> [rows, count] signed integers (the stored value minus 2^(bits-1))."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)  # [32 / bits] values per word
    values = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [rows, words, per_word]
    values = values.reshape(packed.shape[0], -1)[:, :count]
    return values - (1 << (bits - 1))


def weight_args(quantization_config: dict) -> dict:
    """The weight QuantizationArgs of a compressed-tensors config this runtime can dequantize."""
    if quantization_config.get("quant_method") != "compressed-tensors":
        raise CompressedFormatError(
            f"quant_method {quantization_config.get('quant_method')!r}: only compressed-tensors "
            "checkpoints are read (draftsmith's quantize stage writes them)"
        )
    groups = list(quantization_config.get("config_groups", {}).values())
    if len(groups) != 1:
        raise CompressedFormatError(f"{len(groups)} quantization config groups: one W*A16 group is supported")
    group = groups[0]
    fmt = group.get("format") or quantization_config.get("format")
    args = group.get("weights") or {}
    if (
        fmt != "pack-quantized"
        or group.get("input_activations")
        or args.get("type") != "int"
        or args.get("strategy") not in ("group", "channel")
        or 32 % int(args.get("num_bits", 0) or 3)
    ):
        raise CompressedFormatError(
            f"compressed-tensors format {fmt!r} with weights {args}: only pack-quantized "
            "integer weights with group or channel scales (W4A16 / W8A16) are supported"
        )
    return args


def dequantize(tensors: dict[str, Tensor], quantization_config: dict, dtype: torch.dtype) -> dict[str, Tensor]:
    """Replace every packed Linear `X.weight_*` group with a dense `X.weight` in `dtype`."""
    bits = int(weight_args(quantization_config)["num_bits"])
    dense = {}
    for name, tensor in tensors.items():
        if not name.endswith(".weight_packed"):
            if not name.endswith((".weight_scale", ".weight_zero_point", ".weight_shape", ".weight_g_idx")):
                dense[name] = tensor
            continue
        prefix = name.removesuffix("_packed")
        out_features, in_features = (int(v) for v in tensors[prefix + "_shape"])
        scale = tensors[prefix + "_scale"].float()  # [out, groups]
        q = unpack_int32(tensor, bits, in_features).float()  # [out, in]
        zero_point = tensors.get(prefix + "_zero_point")
        if zero_point is not None and zero_point.numel():  # asymmetric; packed along the output dim
            zero_point = unpack_int32(zero_point.T.contiguous(), bits, out_features).T.float()  # [out, groups]
        else:
            zero_point = torch.zeros_like(scale)
        group = in_features // scale.shape[1]
        w = (q.view(out_features, -1, group) - zero_point.unsqueeze(-1)) * scale.unsqueeze(-1)
        dense[prefix] = w.reshape(out_features, in_features).to(dtype)
    return dense
