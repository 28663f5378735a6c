"""Sampling parameters and the target/draft token distributions they define.

Greedy (temperature 0) is the one-hot distribution of the argmax, so the rejection sampler needs no
special case: a greedy draft token is accepted exactly when it equals the target's argmax.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch
from torch import Tensor

if TYPE_CHECKING:
    from draftsmith.serve.penalties import Penalties
    from draftsmith.serve.stops import StopStrings


def to_device(data, device: torch.device | str) -> Tensor:
    """`data` (a list or a CPU tensor) on `device`. To a GPU it goes through pinned memory, without waiting:
    a plain copy from pageable memory waits for every step queued before it, and the host then idles."""
    host = data if isinstance(data, Tensor) else torch.tensor(data)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


class SamplingError(ValueError):
    """A sampling parameter is out of range; the message names it and the allowed range."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    min_p: float = 0.0  # drop tokens less likely than min_p x the likeliest one's probability (0: off)
    seed: int | None = None
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False  # the target's log-probability of each emitted token
    top_logprobs: int = 0  # and of its this-many most likely tokens at each position
    # vLLM's penalties, applied to the target's and the draft's logits alike (serve/penalties.py)
    presence_penalty: float = 0.0  # minus this for each token the output has (OpenAI's definition)
    frequency_penalty: float = 0.0  # minus this times the count of each token in the output
    repetition_penalty: float = 1.0  # logits of tokens in the prompt or output: divided by it if positive, else times it
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit) pairs
    # the stop strings' automaton (serve/stops.py), built once per request off the event loop; None: built when needed
    stop_automaton: "StopStrings | None" = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise SamplingError(f"temperature={self.temperature} must be >= 0 (0 is greedy)")
        if not 0 < self.top_p <= 1:
            raise SamplingError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            raise SamplingError(f"top_k={self.top_k} must be >= 0 (0 disables it)")
        if not 0 <= self.min_p <= 1:
            raise SamplingError(f"min_p={self.min_p} must be in [0, 1] (0 disables it)")
        if self.max_new_tokens < 1:
            raise SamplingError(f"max_new_tokens={self.max_new_tokens} must be >= 1")
        if self.top_logprobs < 0:
            raise SamplingError(f"top_logprobs={self.top_logprobs} must be >= 0")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise SamplingError(f"{name}={getattr(self, name)} must be in [-2, 2]")
        if not 0 < self.repetition_penalty <= 2.0:
            raise SamplingError(f"repetition_penalty={self.repetition_penalty} must be in (0, 2] (1 turns it off)")
        for token, bias in self.logit_bias:
            if not -100.0 <= bias <= 100.0:
                raise SamplingError(f"logit_bias of token {token}: {bias} must be in [-100, 100]")

    @property
    def penalised(self) -> bool:
        """Whether any penalty or logit bias changes this request's distributions."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0 or self.logit_bias)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class RowSampling:
    """Per-row sampling settings of a batch as tensors, so mixed requests share one step."""

    temperature: Tensor  # [B]
    top_p: Tensor  # [B]
    top_k: Tensor  # [B], 0 = off
    greedy: Tensor  # [B] bool
    min_p: Tensor | None = None  # [B], None when no row cuts by min_p
    needs_sort: bool = field(default=False)  # any row with top-p or top-k
    all_greedy: bool = field(default=False)  # argmax suffices: no distributions to build
    any_greedy: bool = field(default=True)  # some row's distribution is one-hot
    penalties: "Penalties | None" = None  # logit bias and penalties, with each row's output so far (serve/penalties.py)

    def penalised(self, logits: Tensor, drafts: Tensor | None = None) -> Tensor:
        """The logits the rows' distributions are made from: with their penalties and logit bias, where
        position t follows the output so far and the drafts before it (Penalties.apply)."""
        return logits if self.penalties is None else self.penalties.apply(logits, drafts)

    @classmethod
    def of(cls, params: list[SamplingParams], device: torch.device) -> "RowSampling":
        return cls(
            temperature=to_device([max(p.temperature, 1e-5) for p in params], device),
            top_p=to_device([p.top_p for p in params], device),
            top_k=to_device([p.top_k for p in params], device),
            greedy=to_device([p.greedy for p in params], device),
            min_p=to_device([p.min_p for p in params], device) if any(p.min_p > 0 for p in params) else None,
            needs_sort=any(p.top_p < 1 or p.top_k > 0 for p in params),
            all_greedy=all(p.greedy for p in params),
            any_greedy=any(p.greedy for p in params),
        )


def probabilities(logits: Tensor, rows: RowSampling) -> Tensor:
    """Token distribution per position after temperature, min-p, top-k and top-p (vLLM's order):
    [B, T, V] float32."""
    logits = logits.float() / rows.temperature.view(-1, 1, 1)
    if rows.min_p is not None:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < rows.min_p.view(-1, 1, 1) * probs.amax(-1, keepdim=True), float("-inf"))
    if rows.needs_sort:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        rank = torch.arange(logits.shape[-1], device=logits.device)
        k = rows.top_k.view(-1, 1, 1)
        drop = (k > 0) & (rank >= k)
        sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        drop = drop | (mass_before >= rows.top_p.view(-1, 1, 1))  # smallest prefix reaching top_p stays
        drop[..., 0] = False
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = logits.softmax(-1)
    if not rows.any_greedy:  # no [B, T, V] one-hot to build and select from
        return probs
    one_hot = torch.nn.functional.one_hot(greedy(logits), logits.shape[-1]).to(probs.dtype)
    return torch.where(rows.greedy.view(-1, 1, 1), one_hot, probs)


@dataclass
class RowGenerators:
    """The batch's generator and, for each row whose request gave a seed, that request's own: a seeded
    request draws the same numbers whatever rows share its steps (at the same K). Every draw is still
    uniform, so sampling stays exact."""

    shared: torch.Generator | None
    rows: dict[int, torch.Generator]

    @classmethod
    def of(cls, shared: torch.Generator | None, rows: dict[int, torch.Generator]) -> "Random":
        """What a batch draws from: the shared generator alone when no row has its own."""
        return cls(shared, rows) if rows else shared


Random = torch.Generator | RowGenerators | None


def _draw(out: Tensor, fill: Callable[[Tensor, torch.Generator | None], Tensor], generator: Random) -> Tensor:
    """`out` [B, ...] filled by `fill`, each seeded row from its own generator."""
    if not isinstance(generator, RowGenerators):
        return fill(out, generator)
    fill(out, generator.shared)
    for row, own in generator.rows.items():
        fill(out[row], own)
    return out


def uniform(shape: tuple[int, ...], device: torch.device, generator: Random) -> Tensor:
    return _draw(torch.empty(shape, device=device), lambda t, g: t.uniform_(generator=g), generator)


def greedy(logits: Tensor) -> Tensor:
    """The argmax over the last dim (the first of equal maxima, as argmax). On a CPU through max(), whose
    kernel took 0.37 ms where argmax took 1.71 over bf16 logits [20, 49,152]."""
    return logits.max(-1).indices if logits.device.type == "cpu" else logits.argmax(-1)


def sample(probs: Tensor, generator: Random) -> Tensor:
    """One token per distribution (exponential race, exact): [B, ..., V] -> [B, ...]."""
    noise = _draw(torch.empty_like(probs), lambda t, g: t.exponential_(generator=g), generator).clamp_min_(1e-30)  # no 0/0
    return (probs / noise).argmax(-1)
