"""Acceptance measured through the engine's own speculative loop, per proposer, temperature and K.

A `Measurement` is one engine run over the held-out prompts: its spec counters (alpha, tau,
acceptance per position) are reproducible for the same inputs and seed; its seconds are not.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from draftsmith.serve.engine import Engine
from draftsmith.serve.proposers import Proposer
from draftsmith.serve.sampling import SamplingParams
from draftsmith.serve.stats import SpecStats


@dataclass
class Measurement:
    proposer: str
    temperature: float
    k: int  # 0: plain decoding with the target alone
    stats: SpecStats
    tokens: int
    seconds: float
    target_steps: int

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict:
        return {"proposer": self.proposer, "temperature": self.temperature, "k": self.k,
                "alpha": self.stats.acceptance_rate, "tau": self.stats.tau,
                "acceptance_by_position": self.stats.acceptance_by_position,
                "num_drafts": self.stats.num_drafts, "num_draft_tokens": self.stats.num_draft_tokens,
                "num_accepted_tokens": self.stats.num_accepted_tokens, "tokens": self.tokens,
                "target_steps": self.target_steps, "seconds": round(self.seconds, 4)}


def measure(engine: Engine, name: str, prompts: Sequence[Sequence[int]], params: SamplingParams, k: int,
            proposer: Proposer | None = None) -> Measurement:
    """Generate for every prompt, engine.max_batch_size at a time, and sum the counters."""
    stats, tokens, seconds, steps = SpecStats(), 0, 0.0, 0
    for i in range(0, len(prompts), engine.max_batch_size):
        generation = engine.generate(prompts[i:i + engine.max_batch_size], params, k, proposer=proposer)
        stats.merge(generation.stats)
        tokens += generation.num_tokens
        seconds += generation.seconds
        steps += generation.target_steps
    return Measurement(name, params.temperature, k, stats, tokens, seconds, steps)
