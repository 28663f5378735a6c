"""The cost model: step times on the evaluation device, predicted speedup per K, and the choice of K.

Leviathan et al. (2023): with per-token acceptance alpha, a step of K drafts emits on average
(1 - alpha^(K+1)) / (1 - alpha) tokens and costs K draft steps plus one target forward over K+1
tokens; the predicted speedup is that expectation times a plain target step over the step's cost.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from draftsmith.serve.speculative import Forward


@dataclass
class StepCosts:
    batch_size: int
    target_ms: float  # one plain decoding step: the target over 1 token per row
    draft_ms: float  # one draft step: the draft over 1 token per row (0 for prompt lookup)
    verify_ms: dict[int, float] = field(default_factory=dict)  # K -> the target over K+1 tokens per row

    def as_dict(self) -> dict:
        return {"batch_size": self.batch_size, "target_ms": round(self.target_ms, 4), "draft_ms": round(self.draft_ms, 4),
                "verify_ms": {str(k): round(v, 4) for k, v in self.verify_ms.items()}}


def time_forward(forward: Forward, batch_size: int, num_tokens: int, device: torch.device, repeats: int = 5) -> float:
    """Median milliseconds of one forward over `num_tokens` tokens per row (after a warm-up call)."""
    tokens = torch.zeros(batch_size, num_tokens, dtype=torch.long, device=device)
    positions = (torch.arange(num_tokens, device=device) + 16).expand(batch_size, num_tokens)  # [B, T]
    times = []
    with torch.inference_mode():
        for i in range(repeats + 1):
            if device.type == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
            forward(tokens, positions)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i:  # the first call warms up (CUDA graph capture, compilation, caches)
                times.append((time.perf_counter() - started) * 1000)
    return sorted(times)[len(times) // 2]


def expected_tokens(alpha: float, k: int) -> float:
    """Mean tokens a step of K drafts emits when each draft is kept with probability alpha."""
    return float(k + 1) if alpha >= 1.0 else (1 - alpha ** (k + 1)) / (1 - alpha)


def predicted_speedup(alpha: float, k: int, costs: StepCosts) -> float:
    return expected_tokens(alpha, k) * costs.target_ms / (k * costs.draft_ms + costs.verify_ms[k])


def choose_k(measured: dict[int, float], predicted: dict[int, float]) -> tuple[int, str]:
    """num_speculative_tokens: the measured best, or the predicted best where nothing was measured."""
    source, speedups = ("measured", measured) if measured else ("predicted", predicted)
    if not speedups:
        raise ValueError("no measured or predicted speedups to choose K from")
    k = max(sorted(speedups), key=lambda k: speedups[k])  # ties go to the smaller K
    why = f"K={k} has the best {source} speedup over plain decoding ({speedups[k]:.2f}x)"
    if speedups[k] < 1.0:
        why += "; every K was slower than plain decoding at this batch size and device: serve with speculation " \
               "off there until the draft's acceptance is higher"
    return k, why
