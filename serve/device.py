"""Where and in what precision the runtime and the stages run: the device choice and the compute dtype.

Both the runtime and the pipeline's stages use these; they live on the ground floor (serve/), which imports
nothing above it.
"""

from __future__ import annotations

import torch


class DeviceError(ValueError):
    """A device was asked for that this machine does not have."""


DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "float64": torch.float64}


def pick_device(name: str = "auto") -> str:
    """auto: the GPU when there is one."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise DeviceError("device=cuda was asked for but torch sees no GPU (use device=auto or device=cpu)")
    return name


def compute_dtype(name: str, device: str) -> torch.dtype:
    """The configured dtype on a GPU. On a CPU: bfloat16 if configured and the CPU multiplies in bf16
    natively (on the 2-core EPYC of the demo, bf16 matmuls ran 2.5x float32's and the evaluate stage took
    153 s against 229 s); float32 otherwise (float16, or bf16 emulated, is slow on a CPU)."""
    dtype = DTYPES[name]
    if device.startswith("cuda") or (dtype == torch.bfloat16 and cpu_has_bf16()):
        return dtype
    return torch.float32


def cpu_has_bf16() -> bool:
    """Whether this CPU has bf16 matmul instructions (AVX512-BF16 or AMX)."""
    return any(getattr(torch.cpu, probe, lambda: False)() for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))
