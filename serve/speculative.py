"""One decoding step, speculative or plain, over a batch of sequences.

State per row: `lengths` tokens are in the target's cache; `pending` is the last emitted token, not
yet fed to the target (it sits at position `lengths`); `previous` is the token at `lengths - 1`.
A draft model re-reads `previous` with `pending` in its first forward, so its cache is complete whether
or not the last step accepted every draft token, and every step has the same shapes; after a plain step
it reads the same two (`Proposer.follow`), so that its cache stays whole while adaptive K drafts nothing. An EAGLE-3 head
instead catches up after the target's forward (`Proposer.follow`) and keeps its hidden state for the
position before `pending` in `draft_hidden`. `text` holds each row's tokens so far on the device (the prompt,
then what was emitted, `pending` at `lengths`): prompt lookup searches it inside the step, with no host in between.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Callable, Sequence

import torch
from torch import Tensor

from draftsmith.serve.rejection import Verifier, rejection_sample
from draftsmith.serve.sampling import Random, RowSampling, greedy, probabilities, sample

if TYPE_CHECKING:
    from draftsmith.serve.proposers import Proposer

# (tokens [B, T], positions [B, T]) -> logits [B, T, V]
Forward = Callable[[Tensor, Tensor], Tensor]
# the target's: logits [B, T, V] and the hidden states an EAGLE-3 head reads [B, T, F] (None without a head)
TargetForward = Callable[[Tensor, Tensor], tuple[Tensor, Tensor | None]]


@dataclass
class DecodeState:
    lengths: Tensor  # [B]
    pending: Tensor  # [B]
    previous: Tensor  # [B]
    draft_hidden: Tensor | None = None  # [B, hidden]: an EAGLE-3 head's output at position lengths - 1
    text: Tensor | None = None  # [B, S]: the row's tokens at 0 .. lengths (pending the last); S - 1 is a spare slot

    def advance(self, active: Tensor, num_accepted: Tensor, fed: Tensor, emitted: Tensor, draft_hidden: Tensor | None = None) -> None:
        """Move active rows past their accepted tokens, in place (a state of views into a larger batch
        advances that batch); finished rows stay where they are.
        fed [B, K+1]: the tokens the target read this step; emitted [B, K+1]: the step's output."""
        at = num_accepted.unsqueeze(1)  # [B, 1]
        previous, pending = fed.gather(1, at).squeeze(1), emitted.gather(1, at).squeeze(1)
        if self.text is not None:  # the emitted tokens follow pending: the kept ones up to the new pending, the
            # rest rewritten by later steps before a search reads them; writes past the end land in the spare slot
            slots = (self.lengths.unsqueeze(1) + 1 + torch.arange(emitted.shape[1], device=emitted.device)).clamp(
                max=self.text.shape[1] - 1
            )
            self.text.scatter_(1, slots, torch.where(active.unsqueeze(1), emitted, self.text.gather(1, slots)))
        self.lengths.copy_(torch.where(active, self.lengths + num_accepted + 1, self.lengths))
        self.previous.copy_(torch.where(active, previous, self.previous))
        self.pending.copy_(torch.where(active, pending, self.pending))
        if draft_hidden is not None:
            self.draft_hidden.copy_(torch.where(active.unsqueeze(1), draft_hidden, self.draft_hidden))

    def copy_(self, other: "DecodeState") -> None:
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if mine is not None:
                mine.copy_(theirs)

    def set_row(self, row: int, other: "DecodeState", source: int = 0) -> None:
        """Row `row` of this state becomes row `source` of `other` (a prefilled request joining a batch)."""
        for f in fields(self):
            if (mine := getattr(self, f.name)) is not None:
                mine[row] = getattr(other, f.name)[source]

    @classmethod
    def idle(
        cls, batch: int, beyond: int, device: torch.device, hidden_size: int | None = None, dtype: torch.dtype = torch.float32
    ) -> "DecodeState":
        """Rows parked at position `beyond` (past the cache's end, so every write lands in its spare slot):
        what graph capture and step timing run on. Their text is `beyond` + 1 tokens wide, `beyond` its spare slot."""
        zeros = lambda: torch.zeros(batch, dtype=torch.long, device=device)
        hidden = torch.zeros(batch, hidden_size, dtype=dtype, device=device) if hidden_size else None
        return cls(zeros() + beyond, zeros(), zeros(), hidden, torch.zeros(batch, beyond + 1, dtype=torch.long, device=device))

    def rows(self, n: int) -> "DecodeState":
        """Views of the first n rows: advancing them advances this state."""
        return DecodeState(*(None if (t := getattr(self, f.name)) is None else t[:n] for f in fields(self)))


@dataclass
class StepOutput:
    num_accepted: Tensor  # [B], 0 for a plain step
    tokens: Tensor  # [B, K+1]: tokens[:, :num_accepted + 1] are emitted
    target_logits: Tensor  # [B, K+1, V], for logprobs
    target_hidden: Tensor | None = None  # [B, K+1, F]: what an EAGLE-3 head reads of the positions the target read


def speculative_step(
    target: TargetForward,
    proposer: "Proposer",
    state: DecodeState,
    k: int,
    rows: RowSampling,
    generator: Random,
    verify: Verifier = rejection_sample,
    histories: Sequence[Sequence[int]] = (),
) -> StepOutput:
    """Propose K tokens, score K+1 positions in one target forward, keep what the verifier accepts.
    `proposer` is a serve.proposers.Proposer; `histories` each row's tokens so far (prompt lookup reads them)."""
    draft_tokens, draft_probs = proposer.propose(state, k, rows, generator, histories)  # [B, K], [B, K, V]
    fed = torch.cat([state.pending.unsqueeze(1), draft_tokens], dim=1)  # [B, K+1]
    positions = state.lengths.unsqueeze(1) + torch.arange(k + 1, device=fed.device)  # [B, K+1]
    target_logits, hidden = target(fed, positions)  # [B, K+1, V]: all K+1 positions in one forward
    scored = rows.penalised(target_logits, draft_tokens)  # position t after the step's first t drafts
    if draft_probs is None:  # greedy: keep drafts while they equal the target's argmax, which also
        target_tokens = greedy(scored)  # gives the correction or bonus token  [B, K+1]
        num_accepted = (draft_tokens == target_tokens[:, :k]).int().cumprod(dim=1).sum(dim=1)
        return StepOutput(num_accepted, target_tokens, target_logits, hidden)
    num_accepted, tokens = verify(draft_tokens, draft_probs, probabilities(scored, rows), generator)
    return StepOutput(num_accepted, tokens, target_logits, hidden)


def plain_step(target: TargetForward, state: DecodeState, rows: RowSampling, generator: Random) -> StepOutput:
    target_logits, hidden = target(state.pending.unsqueeze(1), state.lengths.unsqueeze(1))  # [B, 1, V]
    scored = rows.penalised(target_logits)
    if rows.all_greedy:  # the one-hot distribution's sample is the argmax: skip building it
        tokens = greedy(scored)  # [B, 1]
    else:
        tokens = sample(probabilities(scored, rows), generator)
    return StepOutput(torch.zeros_like(state.lengths), tokens, target_logits, hidden)


def decode_step(
    target: TargetForward,
    proposer: "Proposer | None",
    state: DecodeState,
    active: Tensor,
    k: int,
    rows: RowSampling,
    generator: Random,
    verify: Verifier = rejection_sample,
    histories: Sequence[Sequence[int]] = (),
) -> StepOutput:
    """One step, speculative (K > 0) or plain, then the `active` rows of `state` advance past what it kept."""
    if k > 0:
        out = speculative_step(target, proposer, state, k, rows, generator, verify, histories)
    else:
        out = plain_step(target, state, rows, generator)
    draft_hidden = proposer.follow(state, out) if proposer is not None else None
    if rows.penalties is not None:  # the kept tokens are output now: later positions are penalised for them
        rows.penalties.record(out.tokens, out.num_accepted, active)
    state.advance(active, out.num_accepted, fed_tokens(state, out), out.tokens, draft_hidden)
    return out


def fed_tokens(state: DecodeState, out: StepOutput) -> Tensor:
    """The tokens the target read in the step [B, K+1]: pending, then the accepted drafts."""
    return torch.cat([state.pending.unsqueeze(1), out.tokens[:, :-1]], dim=1)
