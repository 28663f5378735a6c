"""The cost model: whole-step times on the evaluation device, predicted speedup per K, and the choice of K.

A step of K drafts emits tau(K) tokens on average (computed exactly at T = 0, evaluate/acceptance.py) and
costs one whole speculative step (the K proposals, the target over K+1 tokens, acceptance), timed on
the device at the evaluation batch size; plain decoding emits one token per plain step. The predicted
speedup is tau(K) x plain step / speculative step. (Where only alpha is known, adaptive K in the runtime
uses serve.stats.expected_tokens.)
"""

from __future__ import annotations

import time

import torch

from draftsmith.serve.speculative import Forward


def time_forward(forward: Forward, batch_size: int, num_tokens: int, device: torch.device, repeats: int = 5, start: int = 16) -> float:
    """Median milliseconds of one forward over `num_tokens` tokens per row at positions start.. (after a
    warm-up call)."""
    tokens = torch.zeros(batch_size, num_tokens, dtype=torch.long, device=device)
    positions = (torch.arange(num_tokens, device=device) + start).expand(batch_size, num_tokens)  # [B, T]
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


def faster_than_plain(step_ms: dict[int, float], slack: float = 0.9) -> list[int]:
    """The Ks whose step (step_ms: K -> ms, 0 plain) was timed well under a plain step's: a speculative step
    runs the target over K + 1 tokens besides its drafts, so it should not be cheaper than one over a single
    token: such times say that something else had the device while they were taken, or that the plain step
    took a slow path of its own (on a CPU in bf16 a one-token attention kernel once did)."""
    return [k for k, ms in step_ms.items() if k and ms < slack * step_ms[0]]


def predicted_speedup(tau: float, plain_step_ms: float, step_ms: float) -> float:
    """tau tokens per speculative step of step_ms, against one token per plain step of plain_step_ms."""
    return tau * plain_step_ms / step_ms


def predicted_speedups(tau: dict[int, float], step_ms: dict[int, float]) -> dict[int, float]:
    """K -> predicted speedup, for each K >= 1 of step_ms (K -> ms, 0 plain) and tau (K -> tokens a step)."""
    return {k: predicted_speedup(tau[k], step_ms[0], ms) for k, ms in step_ms.items() if k}


def choose_k(speedups: dict[int, float], source: str = "predicted") -> tuple[int, str]:
    """num_speculative_tokens: the K with the best speedup (ties to the smaller K), with the reason."""
    if not speedups:
        raise ValueError("no speedups to choose K from")
    k = max(sorted(speedups), key=lambda k: speedups[k])
    why = f"K={k} has the best {source} speedup over plain decoding ({speedups[k]:.2f}x)"
    if speedups[k] < 1.0:
        why += (
            "; every K was slower than plain decoding at this batch size and device: serve with speculation "
            "off there until the draft's acceptance is higher"
        )
    return k, why


PROMPT_LOOKUP, INITIAL = "prompt_lookup", "initial"  # the evaluate stage's names for these proposers
LOOKUP_FIRST = "lookup_first"  # the shipped draft with prompt lookup first (draftsmith serve --lookup-first)
ALTERNATIVES = (PROMPT_LOOKUP, INITIAL)  # what could ship instead of the trained draft


def faster_than_shipped(predicted: dict[str, dict[int, float]], shipped: str, margin: float = 1.05) -> list[tuple[str, int, float]]:
    """The alternatives to the shipped draft (prompt lookup, the draft before training) whose best predicted
    speedup beats the shipped draft's best by more than `margin` (the step timings' noise), as (name, its
    best K, that speedup), fastest first: on code, prompt lookup needs no draft and can out-decode a trained
    one (a cheaper step at equal tau). A W4A16 draft's bf16 twin is no alternative: it runs at the same
    timed cost, and what quantization loses is gated by evaluate.max_tau_loss."""
    best = lambda curve: max(sorted(curve), key=lambda k: curve[k])
    bar = margin * max(predicted[shipped].values())
    rivals = [(name, best(curve), curve[best(curve)]) for name, curve in predicted.items() if name in ALTERNATIVES and curve]
    return sorted((r for r in rivals if r[2] > bar), key=lambda r: -r[2])


def faster_notes(predicted: dict[str, dict[int, float]], shipped: str) -> list[str]:
    """A sentence for each alternative `faster_than_shipped` names, for eval.md and the stage's log."""
    best = max(predicted[shipped].values())
    return [
        f"{name} is predicted faster than the shipped draft here: {x:.2f}x at K={k} against {best:.2f}x."
        for name, k, x in faster_than_shipped(predicted, shipped)
    ]
