"""Acceptance of every proposer at every K from one teacher-forced pass, and the engine run that checks it.

At T = 0 the output is the target's greedy text whatever the proposer and K, and a draft that has
agreed so far has seen exactly the target's tokens. So per held-out prompt, one greedy continuation of
the target (max_new_tokens + K_max tokens, EOS not honoured: the last step may look past the end) and
one teacher-forced pass of a proposer over it say, for every point m where a step may start (m tokens
emitted, the m-th pending), whether each of the next K_max drafts would be accepted. Replaying the
engine's steps over that (`replay`: stops at EOS and max_new_tokens as the engine does) gives alpha, tau
and acceptance by position for every K exactly as the engine counts them. At T > 0 the same pass over
target-sampled text gives each draft's acceptance probability, sum_v min(p(v), q(v)) = 1 - TVD
(Leviathan et al.), and the replay becomes an expectation over where steps start.

Where the j-th draft of a step starting at m is verified: against the target's distribution at position
u = L + m + j - 2 (L prompt tokens), whose token is u + 1. A draft model's proposal there is its
teacher-forced prediction at u; an EAGLE-3 head's is its unrolled step j - 1 at entry L + m - 2 (it
feeds on its own hidden states, so it is unrolled from every position at once, serve/eagle.py);
prompt lookup's is a function of the text so far.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from draftsmith.serve.eagle import EagleHead
from draftsmith.serve.engine import Engine
from draftsmith.serve.model import Transformer
from draftsmith.serve.proposers import Proposer, full_vocab_logits, lookup, lookup_match
from draftsmith.serve.sampling import RowSampling, SamplingParams, probabilities
from draftsmith.serve.scheduler import Scheduler
from draftsmith.serve.stats import SpecStats


@dataclass
class Reference:
    prompt: list[int]
    tokens: list[int]  # the target's continuation y_1 .. y_(N + K_max), EOS not honoured
    end: int  # steps start at m = 1 .. end: before EOS and max_new_tokens end the sequence

    @property
    def sequence(self) -> list[int]:
        return self.prompt + self.tokens


def references(engine: Engine, prompts: Sequence[Sequence[int]], params: SamplingParams, k_max: int) -> list[Reference]:
    """The target's continuation of each prompt (plain decoding, `engine.max_batch_size` at a time)."""
    n = params.max_new_tokens
    longer = replace(params, max_new_tokens=n + k_max, ignore_eos=True)
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(engine.eos_token_ids))
    refs = []
    for i in range(0, len(prompts), engine.max_batch_size):
        for c in engine.generate(prompts[i : i + engine.max_batch_size], longer).completions:
            stop = next((m for m, t in enumerate(c.tokens, 1) if t in stops), None)  # the m-th token ends it
            refs.append(Reference(list(c.prompt_tokens), c.tokens, min(n, stop or n) - 1))
    return refs


def reach(accept: np.ndarray, end: int, k: int) -> np.ndarray:
    """P(a step of the engine starts at m), m = 0 .. end + K + 1, over one sequence whose j-th draft from a step at
    m is accepted with probability accept[m, j] (0 or 1 at T = 0)."""
    starts = np.zeros(end + k + 2)
    starts[1] = 1.0
    for m in range(1, end + 1):
        if starts[m]:
            at_least = np.cumprod(accept[m, 1 : k + 1])  # P(n >= j), j = 1..K
            starts[m + 1 : m + k + 2] += starts[m] * (np.append(1.0, at_least) - np.append(at_least, 0.0))  # P(n = 0..K)
    return starts


def replay(accept: np.ndarray, end: int, k: int) -> tuple[float, float, np.ndarray]:
    """The engine's steps with K drafts over one sequence (`reach`): expected (steps, accepted drafts, accepted
    per position)."""
    starts = reach(accept, end, k)[1 : end + 1]
    by_position = starts @ np.cumprod(accept[1 : end + 1, 1 : k + 1], axis=1)
    return starts.sum(), by_position.sum(), by_position


@dataclass
class Computed:
    """Expected engine counters of one proposer at one temperature and K over the references."""

    proposer: str
    temperature: float
    k: int
    steps: float
    accepted: float
    by_position: list[float]

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / (self.k * self.steps) if self.steps else 0.0

    @property
    def tau(self) -> float:
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0

    def as_dict(self) -> dict:
        return {
            "proposer": self.proposer,
            "temperature": self.temperature,
            "k": self.k,
            "acceptance_rate": self.acceptance_rate,
            "tau": self.tau,
            "acceptance_by_position": [a / self.steps if self.steps else 0.0 for a in self.by_position],
            "num_drafts": self.steps,
            "num_draft_tokens": self.k * self.steps,
            "num_accepted_tokens": self.accepted,
        }


def computed_rows(name: str, temperature: float, accepts: list[np.ndarray], refs: list[Reference], k_max: int) -> list[Computed]:
    rows = []
    for k in range(1, k_max + 1):
        steps, accepted, by_position = 0.0, 0.0, np.zeros(k)
        for accept, ref in zip(accepts, refs):
            s, a, b = replay(accept, ref.end, k)
            steps, accepted, by_position = steps + s, accepted + a, by_position + b
        rows.append(Computed(name, temperature, k, steps, accepted, by_position.tolist()))
    return rows


# -- per-draft acceptance of each proposer ----------------------------------------------------------------


def _padded(refs: list[Reference], device: torch.device) -> tuple[Tensor, Tensor]:
    longest = max(len(r.sequence) for r in refs)
    tokens = torch.zeros(len(refs), longest, dtype=torch.long, device=device)
    for i, r in enumerate(refs):
        tokens[i, : len(r.sequence)] = torch.tensor(r.sequence, device=device)
    return tokens, torch.arange(longest, device=device).expand(len(refs), longest)


def _agreement(
    proposal_logits: Tensor, vocab: Tensor | None, vocab_size: int, target_probs: Tensor | None, following: Tensor, rows: RowSampling
) -> Tensor:
    """Per position [B, T]: at T = 0 (target_probs None) whether the proposal (argmax) equals the following
    token; at T > 0 the probability that a draw from the proposer's distribution is accepted,
    sum_v min(p(v), q(v))."""
    if target_probs is None:
        best = proposal_logits.argmax(-1)
        return ((best if vocab is None else vocab[best]) == following).double()
    q = probabilities(full_vocab_logits(proposal_logits, vocab, vocab_size), rows)
    return torch.minimum(target_probs, q).sum(-1).double()


Proposal = Transformer | EagleHead | None  # None: prompt lookup


@torch.inference_mode()
def acceptance(
    target: Transformer, proposers: dict[str, Proposal], refs: list[Reference], params: SamplingParams, k_max: int, batch_size: int
) -> dict[str, list[np.ndarray]]:
    """accept[m, j] (shape [end + 1, K_max + 1]) per reference and proposer: one forward of the target per
    batch of references (at T > 0, or for the hidden states a head reads) and one of each model."""
    device, vocab_size = target.output.weight.device, target.args.vocab_size
    out: dict[str, list[np.ndarray]] = {name: [] for name in proposers}
    heads = {name: p for name, p in proposers.items() if isinstance(p, EagleHead)}
    layers = tuple(sorted({i for head in heads.values() for i in head.aux_layers}))
    for i in range(0, len(refs), batch_size):
        chunk = refs[i : i + batch_size]
        tokens, positions = _padded(chunk, device)
        B, S = tokens.shape
        rows = RowSampling.of([params] * B, device)
        following = torch.cat([tokens[:, 1:], tokens[:, :1]], dim=1)  # [B, S]: the token after each position
        target_probs, features = None, None
        if layers or not params.greedy:
            target.setup_cache(B, S)
            logits, features = target(tokens, positions, hidden_layers=layers) if layers else (target(tokens, positions), None)
            target_probs = None if params.greedy else probabilities(logits, rows)  # [B, S, V]
        for name, proposer in proposers.items():
            if proposer is None:
                per_position = None
            elif isinstance(proposer, EagleHead):
                entering = dict(zip(layers, features.split(target.args.hidden_size, dim=-1)))
                head_features = torch.cat([entering[layer] for layer in proposer.aux_layers], dim=-1)
                steps = []
                for j, hidden in enumerate(proposer.unroll(tokens, head_features, target.tok_embeddings, k_max)):
                    # step j's entry t is verified against the target at t + j + 1, whose token is at t + j + 2
                    shift = lambda x: None if x is None else torch.cat([x[:, j + 1 :], x[:, : j + 1]], dim=1)[:, : S - 1]
                    steps.append(
                        _agreement(proposer.logits(hidden), proposer.vocab, vocab_size, shift(target_probs), shift(following), rows)
                    )  # [B, E]
                per_step = torch.stack(steps, dim=1).cpu().numpy()  # [B, K_max, E]
            else:
                proposer.setup_cache(B, S)
                per_position = (
                    _agreement(proposer(tokens, positions), proposer.vocab, vocab_size, target_probs, following, rows).cpu().numpy()
                )  # [B, S]
            for b, ref in enumerate(chunk):
                if proposer is None:
                    out[name].append(_lookup_accept(ref, k_max, None if target_probs is None else target_probs[b]))
                    continue
                accept = np.zeros((ref.end + 1, k_max + 1))
                m = np.arange(1, ref.end + 1)[:, None]
                j = np.arange(1, k_max + 1)[None, :]
                start = len(ref.prompt) - 2 + m  # the entry / position before the step's pending token
                if ref.end:
                    accept[1:, 1:] = per_step[b, j - 1, start] if isinstance(proposer, EagleHead) else per_position[b, start + j]
                out[name].append(accept)
    return out


def _lookup_accept(ref: Reference, k_max: int, target_probs: Tensor | None, max_ngram: int = 3, min_ngram: int = 1) -> np.ndarray:
    """Prompt lookup (serve.proposers.lookup) along one reference: its proposal is exact at T = 0 when it
    equals the target's token, and kept with probability p(token) at T > 0."""
    sequence, L = ref.sequence, len(ref.prompt)
    accept = np.zeros((ref.end + 1, k_max + 1))
    for m in range(1, ref.end + 1):
        drafts = lookup(sequence[: L + m], k_max, max_ngram, min_ngram)
        if target_probs is None:
            accept[m, 1:] = [d == t for d, t in zip(drafts, sequence[L + m : L + m + k_max])]
        else:
            accept[m, 1:] = [target_probs[L + m + j - 2, d].item() for j, d in enumerate(drafts, 1)]
    return accept


def matched_lengths(ref: Reference, max_ngram: int = 3) -> list[int]:
    """At each step m = 0 .. end along a reference: the length of the final n-gram (at most max_ngram) of the text
    so far that occurred earlier in it (serve.proposers.lookup_match; 0 at m = 0, where no step starts)."""
    return [0] + [lookup_match(ref.sequence[: len(ref.prompt) + m], 1, max_ngram, 1)[1] for m in range(1, ref.end + 1)]


def lookup_first(draft: list[np.ndarray], lookup: list[np.ndarray], refs: list[Reference], min_match: int = 3) -> list[np.ndarray]:
    """accept[m, j] of the draft with prompt lookup first (serve.proposers.LookupFirst) along each reference, from
    the draft's and the lookup's: at each step the lookup's where the text so far ends in `min_match` tokens that
    occurred earlier in it, the draft's elsewhere (the engine chooses so per row, at any batch size)."""
    return [np.where((np.asarray(matched_lengths(ref)) >= min_match)[:, None], found, d) for d, found, ref in zip(draft, lookup, refs)]


# -- the engine, as the cross-check and the speed measurement ------------------------------------------


@dataclass
class Measurement:
    proposer: str
    temperature: float
    k: int  # 0: plain decoding with the target alone
    stats: SpecStats
    tokens: int
    seconds: float
    target_steps: int
    outputs: list[list[int]]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict:
        return {
            "proposer": self.proposer,
            "temperature": self.temperature,
            "k": self.k,
            "acceptance_rate": self.stats.acceptance_rate,
            "tau": self.stats.tau,
            "acceptance_by_position": self.stats.acceptance_by_position,
            "num_drafts": self.stats.num_drafts,
            "num_draft_tokens": self.stats.num_draft_tokens,
            "num_accepted_tokens": self.stats.num_accepted_tokens,
            "tokens": self.tokens,
            "target_steps": self.target_steps,
            "seconds": round(self.seconds, 4),
            "tokens_per_s": round(self.tokens_per_s, 2),
        }


def measure(
    engine: Engine, name: str, prompts: Sequence[Sequence[int]], params: SamplingParams, k: int, proposer: Proposer | None = None
) -> Measurement:
    """Every prompt through the continuous-batching scheduler at a fixed K, engine.max_batch_size rows at
    once, as a server runs them: a request joins where another finishes. (Batches that each waited for
    their slowest row measured 1.12x at batch 32 on the H200 where the head's tau predicted 2.14x.)"""
    started = time.perf_counter()
    # one generator seeded once for the whole run (a seed in each request's params would give every request
    # the same random draws)
    scheduler = Scheduler(engine, k, adaptive=False, seed=params.seed, proposer=proposer)
    completions, steps, stats = scheduler.run_all(prompts, replace(params, seed=None))
    seconds = time.perf_counter() - started  # the last step's tokens were read back: the device is done
    outputs = [c.tokens for c in completions]
    return Measurement(name, params.temperature, k, stats, sum(map(len, outputs)), seconds, steps, outputs)
