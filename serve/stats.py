"""Speculative-decoding counters, counted in one place, and the names every report, metric and table uses.

Glossary (vLLM's terms; eval.json, /metrics, bench tables and the model card follow it):
- a draft: one speculative step of one sequence, in which a proposer drafts K tokens (the draft tokens);
- accepted tokens: the leading draft tokens the target keeps. The step then emits one token of the target's
  own: the recovered token where a draft was refused, the bonus token when all K were kept;
- alpha: the chance that the target keeps a draft token, given that it kept the ones before; measured as
  the acceptance rate at K = 1, and what the evaluation gate (evaluate.min_alpha) reads;
- acceptance_rate: accepted tokens / draft tokens at a given K (vLLM's acceptance rate). At K = 1 it is
  alpha; for the same alpha it falls as K grows ((tau - 1) / K);
- tau: mean tokens emitted per step (vLLM's mean acceptance length, bonus token included) = 1 + accepted
  tokens / drafts; for a per-token alpha, (1 - alpha^(K+1)) / (1 - alpha) (expected_tokens);
- acceptance_by_position[i]: the fraction of drafts whose (i+1)-th draft token was accepted.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    num_drafts: int = 0  # verification steps (one per sequence per step)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: steps that accepted position i
    drafts_per_position: list[int] = field(default_factory=list)  # [i]: steps that drafted position i

    def record(self, k: int, num_accepted: list[int]) -> None:
        """Count one step of K drafted tokens for each sequence, with its accepted count."""
        grow = k - len(self.accepted_per_position)
        if grow > 0:
            self.accepted_per_position += [0] * grow
            self.drafts_per_position += [0] * grow
        for n in num_accepted:
            self.num_drafts += 1
            self.num_draft_tokens += k
            self.num_accepted_tokens += n
            for i in range(k):
                self.drafts_per_position[i] += 1
                self.accepted_per_position[i] += i < n

    def merge(self, other: "SpecStats") -> None:
        k = max(len(self.accepted_per_position), len(other.accepted_per_position))
        pad = lambda xs: xs + [0] * (k - len(xs))
        self.accepted_per_position = [a + b for a, b in zip(pad(self.accepted_per_position), pad(other.accepted_per_position))]
        self.drafts_per_position = [a + b for a, b in zip(pad(self.drafts_per_position), pad(other.drafts_per_position))]
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens over draft tokens (alpha when K = 1)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def tau(self) -> float:
        """Mean tokens emitted per verification step: accepted drafts plus the corrected/bonus token."""
        return (self.num_accepted_tokens + self.num_drafts) / self.num_drafts if self.num_drafts else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        """P(position i accepted), over steps that drafted position i."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafts_per_position)]

    def as_dict(self) -> dict:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "tau": self.tau,
            "acceptance_by_position": self.acceptance_by_position,
        }


def expected_tokens(alpha: float, k: int) -> float:
    """tau: mean tokens a step of K drafts emits when each draft is kept with probability alpha (Leviathan
    et al.'s expected length)."""
    return float(k + 1) if alpha >= 1.0 else (1 - alpha ** (k + 1)) / (1 - alpha)
