"""Proposers: where the K speculative tokens come from, behind one small interface.

A proposer returns the K tokens it proposes for each row [B, K] and the distributions they were drawn
from [B, K, V] (None when the whole batch is greedy, whose verification needs only the tokens).
`DraftModel` runs a small LM; `EagleHead` an EAGLE-3 head on the target's hidden states;
`PromptLookup` copies what followed the last earlier occurrence of the sequence's final n-gram (prompt
lookup decoding), at no model cost. A model proposer may draw from a subset of the vocabulary (its
frequent tokens: a cheaper LM head); a token outside it is simply never proposed, and at T > 0 its
distribution is renormalised over the subset, so verification stays exact.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Protocol, Sequence

import numpy as np
import torch
from torch import Tensor

from draftsmith.serve.eagle import EagleHead
from draftsmith.serve.model import Transformer
from draftsmith.serve.sampling import Random, RowSampling, greedy, probabilities, sample
from draftsmith.serve.speculative import DecodeState, Forward, StepOutput, fed_tokens

VOCAB_FILE = "draft_vocab.json"  # beside a draft model: the token ids it proposes from ({"token_ids": [...]})


def read_vocab(directory: Path) -> list[int] | None:
    """The draft vocabulary saved in `directory` (a distill output or a bundle), if there is one."""
    path = Path(directory) / VOCAB_FILE
    return json.loads(path.read_text())["token_ids"] if path.is_file() else None


class Proposer(Protocol):
    reads_history: bool  # whether propose() needs each row's tokens so far

    def propose(
        self, state: DecodeState, k: int, rows: RowSampling, generator: Random, histories: Sequence[Sequence[int]]
    ) -> tuple[Tensor, Tensor | None]: ...

    def prefill(
        self, tokens: Tensor, positions: Tensor, lengths: Tensor, first: Tensor, target_hidden: Tensor | None, cache_rows: Tensor | None
    ) -> Tensor | None:
        """Read the prompts (tokens, positions [B, T], right-padded to `lengths`; `first` [B] the token
        sampled after them); returns the state's draft_hidden (None when it keeps none)."""

    def follow(self, state: DecodeState, out: StepOutput) -> Tensor | None:
        """After the target's forward in a step: the state's next draft_hidden (None when it keeps none)."""


def full_vocab_logits(logits: Tensor, vocab: Tensor | None, vocab_size: int) -> Tensor:
    """Logits [..., V'] over `vocab` (target ids; None: already the whole vocabulary) as [..., V], -inf
    (probability 0) outside the subset."""
    if vocab is None:
        return logits
    return logits.new_full((*logits.shape[:-1], vocab_size), float("-inf")).index_copy_(-1, vocab, logits)


def draw(
    logits: Tensor, vocab: Tensor | None, vocab_size: int, rows: RowSampling, generator: Random, drafts: list[Tensor]
) -> tuple[Tensor, Tensor | None]:
    """One proposal per row from logits [B, 1, V'] over `vocab`, after the step's `drafts` so far: the
    tokens [B, 1] as target ids, and the distributions [B, 1, V] they were drawn from (None if greedy).
    Penalties and logit bias apply as to the target's logits (serve/penalties.py)."""
    if rows.penalties is not None:
        logits = rows.penalised(full_vocab_logits(logits, vocab, vocab_size), torch.cat(drafts, dim=1) if drafts else None)
        vocab = None
    if rows.all_greedy:
        best = greedy(logits)
        return (best if vocab is None else vocab[best]), None
    q = probabilities(full_vocab_logits(logits, vocab, vocab_size), rows)  # [B, 1, V]
    return sample(q, generator), q


class DraftModel:
    reads_history = False

    def __init__(self, model: Transformer, forward: Forward, vocab_size: int, prompt_forward: Callable | None = None):
        self.model, self.forward, self.vocab_size = model, forward, vocab_size  # forward: model's, maybe graphed
        self.prompt_forward = prompt_forward  # (tokens, positions, lengths, cache_rows): the graphed prefill, if any

    def propose(
        self, state: DecodeState, k: int, rows: RowSampling, generator: Random, histories: Sequence[Sequence[int]] = ()
    ) -> tuple[Tensor, Tensor | None]:
        positions = state.lengths.unsqueeze(1)  # [B, 1]
        # the draft re-reads `previous` with `pending`, so its cache is whole after any rejection
        logits = self.forward(torch.stack([state.previous, state.pending], dim=1), torch.cat([positions - 1, positions], dim=1))
        tokens, probs = [], []
        for i in range(k):
            token, q = draw(logits[:, -1:], self.model.vocab, self.vocab_size, rows, generator, tokens)
            tokens.append(token)
            if q is not None:
                probs.append(q)
            if i + 1 < k:
                logits = self.forward(token, positions + i + 1)
        return torch.cat(tokens, dim=1), (torch.cat(probs, dim=1) if probs else None)

    def prefill(self, tokens, positions, lengths, first, target_hidden, cache_rows) -> None:
        # the prompts into the draft's cache; its logits are not wanted: the LM head runs at one position a row
        if self.prompt_forward is not None:
            self.prompt_forward(tokens, positions, lengths, cache_rows)
        else:
            self.model(tokens, positions, cache_rows=cache_rows, logits_at=(lengths - 1).unsqueeze(1))

    def follow(self, state: DecodeState, out: StepOutput) -> None:
        """After a plain step (one token out, nothing drafted), read what the next speculative step's
        first forward expects to be cached (`previous` and `pending`, as that forward does): without it the
        positions of plain steps stay missing from the draft's cache, and once adaptive K turns
        speculation off its drafts stay wrong when it turns it back on. After a speculative step nothing:
        the next one re-reads them itself."""
        if out.tokens.shape[1] == 1:
            positions = state.lengths.unsqueeze(1)
            self.forward(torch.stack([state.previous, state.pending], dim=1), torch.cat([positions - 1, positions], dim=1))
        return None

    def read(self, state: DecodeState, out: StepOutput) -> None:
        """After a step whose drafts were not (all) this model's: read the tokens the target read, at their
        positions, so that the cache holds what the next step's drafting assumes (the entries past what the
        step kept are rewritten later)."""
        positions = state.lengths.unsqueeze(1) + torch.arange(out.tokens.shape[1], device=out.tokens.device)
        self.forward(fed_tokens(state, out), positions)


class EagleProposer:
    """An EAGLE-3 head: proposals from the head's hidden state for the position before `pending`
    (state.draft_hidden), each next one from the head's own output; after the target's forward the
    head reads the positions the target read, with their hidden states (serve/eagle.py)."""

    reads_history = False

    def __init__(self, head: EagleHead, embeddings: torch.nn.Embedding, fused: bool = False):
        self.head, self.embeddings, self.fused = head, embeddings, fused

    def propose(
        self, state: DecodeState, k: int, rows: RowSampling, generator: Random, histories: Sequence[Sequence[int]] = ()
    ) -> tuple[Tensor, Tensor | None]:
        hidden = state.draft_hidden.unsqueeze(1)  # [B, 1, hidden]: the entry of position lengths - 1
        tokens, probs = [], []
        for i in range(k):
            token, q = draw(self.head.logits(hidden), self.head.vocab, self.head.args.vocab_size, rows, generator, tokens)
            tokens.append(token)
            if q is not None:
                probs.append(q)
            if i + 1 < k:  # the entry of position lengths + i reads the token just proposed for lengths + i + 1
                positions = (state.lengths + i).unsqueeze(1)
                hidden = self.head(self.embeddings(token), hidden, positions, fused=self.fused)
        return torch.cat(tokens, dim=1), (torch.cat(probs, dim=1) if probs else None)

    def prefill(
        self, tokens: Tensor, positions: Tensor, lengths: Tensor, first: Tensor, target_hidden: Tensor, cache_rows: Tensor | None
    ) -> Tensor:
        # the entry of position t reads the token at t + 1: the prompt shifted left, then the first sampled token
        following = torch.cat([tokens[:, 1:], tokens[:, :1]], dim=1).scatter(1, (lengths - 1).unsqueeze(1), first.unsqueeze(1))
        hidden = self.head(self.embeddings(following), self.head.fc(target_hidden), positions, cache_rows=cache_rows)
        return hidden.gather(1, (lengths - 1).view(-1, 1, 1).expand(-1, 1, hidden.shape[-1])).squeeze(1)  # [B, hidden]

    def follow(self, state: DecodeState, out: StepOutput) -> Tensor:
        # the entries of the positions the target read, lengths .. lengths + K: each reads the token the
        # step emitted after it (right where it was accepted; its successors are rewritten next step)
        positions = state.lengths.unsqueeze(1) + torch.arange(out.tokens.shape[1], device=out.tokens.device)
        hidden = self.head(self.embeddings(out.tokens), self.head.fc(out.target_hidden), positions, fused=self.fused)
        return hidden.gather(1, out.num_accepted.view(-1, 1, 1).expand(-1, 1, hidden.shape[-1])).squeeze(1)


def lookup(history: Sequence[int], k: int, max_ngram: int, min_ngram: int) -> list[int]:
    """The K tokens after the latest earlier occurrence of the history's longest final n-gram
    (n from max_ngram down to min_ngram); where fewer follow, or none match, the last token repeats."""
    return lookup_match(history, k, max_ngram, min_ngram)[0]


def lookup_match(history: Sequence[int], k: int, max_ngram: int, min_ngram: int) -> tuple[list[int], int]:
    """`lookup`'s K tokens and the length n of the n-gram they follow (0: none matched). The search is
    vectorised: it runs on the host between a step and the next launch, for every row of a batch, over the
    whole text so far (a Python loop over the starts took ~0.2 ms a row of 500 tokens)."""
    h = np.asarray(history)
    length = len(h)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        match = h[: length - n] == h[length - n]  # starts 0 .. length - n - 1: never the final n-gram itself
        for i in range(1, n):
            match &= h[i : length - n + i] == h[length - n + i]
        found = np.flatnonzero(match)
        if len(found):
            start = int(found[-1]) + n  # the latest match
            follow = [int(t) for t in h[start : start + k]]
            return follow + [follow[-1]] * (k - len(follow)), n
    return [int(h[-1])] * k, 0


def one_hot_q(tokens: Tensor, rows: RowSampling, vocab_size: int) -> Tensor | None:
    """The q of deterministic proposals [B, K] (prompt lookup's): a draw from a one-hot q is kept with probability
    p(token). None when greedy."""
    return None if rows.all_greedy else torch.nn.functional.one_hot(tokens, vocab_size).float()  # [B, K, V]


def lookup_rows(text: Tensor, lengths: Tensor, k: int, max_ngram: int, min_ngram: int) -> tuple[Tensor, Tensor]:
    """`lookup_match` for every row at once, on the text's device with no host in between (inside a step's CUDA
    graph too): row b's history is text[b, : lengths[b] + 1] (DecodeState.text). Returns the drafts [B, K] and
    the length of the n-gram they follow [B] (0: none matched, the last token repeats)."""
    S, device = text.shape[1], text.device
    ends = lengths + 1  # [B]: each history's length
    start = ends - 1  # where the drafts are copied from: the last token, where nothing matches
    matched = torch.zeros_like(lengths)
    for n in range(min_ngram, min(max_ngram, S - 1) + 1):  # a longer n-gram's match overrides a shorter one's
        final = text.gather(1, (ends.unsqueeze(1) - n + torch.arange(n, device=device)).clamp(min=0))  # [B, n]
        match = text[:, : S - n + 1] == final[:, :1]  # starts 0 .. S - n
        for i in range(1, n):
            match &= text[:, i : S - n + 1 + i] == final[:, i : i + 1]
        starts = torch.arange(S - n + 1, device=device)
        match &= starts < (ends - n).unsqueeze(1)  # never the final n-gram itself, nor past the history
        latest = torch.where(match, starts, -1).amax(dim=1)  # [B]
        start = torch.where(latest >= 0, latest + n, start)
        matched = torch.where(latest >= 0, n, matched)
    # the K tokens from `start`; where fewer follow, the history's last one repeats
    at = torch.minimum(start.unsqueeze(1) + torch.arange(k, device=device), (ends - 1).unsqueeze(1))
    return text.gather(1, at), matched


class PromptLookup:
    """Prompt lookup decoding: each row's drafts are what followed the latest earlier occurrence of its text's
    final n-gram (`lookup_match`), searched on the device in the state's `text` (`lookup_rows`): a step needs
    no host work, so the next one is launched while the device runs it, and greedy steps run as CUDA graphs."""

    reads_history = False

    def __init__(self, vocab_size: int, max_ngram: int = 3, min_ngram: int = 1):
        self.vocab_size, self.max_ngram, self.min_ngram = vocab_size, max_ngram, min_ngram

    def propose(
        self, state: DecodeState, k: int, rows: RowSampling, generator: Random, histories: Sequence[Sequence[int]] = ()
    ) -> tuple[Tensor, Tensor | None]:
        tokens, _ = lookup_rows(state.text, state.lengths, k, self.max_ngram, self.min_ngram)  # [B, K]
        return tokens, one_hot_q(tokens, rows, self.vocab_size)

    def prefill(self, tokens, positions, lengths, first, target_hidden, cache_rows) -> None:
        return None

    def follow(self, state: DecodeState, out: StepOutput) -> None:
        return None


class LookupFirst:
    """Prompt lookup where a row's text already holds its final `min_match` tokens (code that repeats its
    prompt, say), the draft (a draft model or an EAGLE-3 head) for the other rows. Which proposer drafts a row
    is decided from its text alone, so verification stays exact, and the draft's state follows every step
    either way. Two ways to decide, one per instance:
    - on the host (the default): each step's drafts go through GivenDrafts, as in a step's CUDA graph
      (Engine.step), and in a step where every row has a match the draft does not run at all; the host reads
      each step's tokens before the next launch.
    - on the device (`on_device`): the state's text is searched inside the step (`lookup_rows`), so the next
      step is launched while the device runs this one; the draft runs every step, and a draft model reads the
      tokens the target read after each."""

    def __init__(
        self, draft: "DraftModel | EagleProposer", vocab_size: int, min_match: int = 3, max_ngram: int = 3, on_device: bool = False
    ):
        if not 1 <= min_match <= max_ngram:
            raise ValueError(f"min_match must be 1..max_ngram ({max_ngram}), got {min_match}")
        self.draft, self.vocab_size, self.max_ngram, self.min_match = draft, vocab_size, max_ngram, min_match
        self.on_device = on_device
        self._step: "DraftModel | EagleProposer | GivenDrafts" = draft  # what proposed the last step's drafts

    @property
    def reads_history(self) -> bool:
        return not self.on_device

    def plan(self, histories: Sequence[Sequence[int]], k: int) -> tuple[list[list[int]], list[bool]]:
        """Each row's K lookup drafts, and which rows take them (their final `min_match` tokens repeat)."""
        found = [lookup_match(h, k, self.max_ngram, 1) for h in histories]
        return [tokens for tokens, _ in found], [n >= self.min_match for _, n in found]

    def propose(
        self, state: DecodeState, k: int, rows: RowSampling, generator: Random, histories: Sequence[Sequence[int]] = ()
    ) -> tuple[Tensor, Tensor | None]:
        if self.on_device:
            drafts, matched = lookup_rows(state.text, state.lengths, k, self.max_ngram, 1)
            self._step = GivenDrafts(self.draft, drafts, matched >= self.min_match, self.vocab_size)
        else:
            drafts, use = self.plan(histories, k)
            self._step = self.draft
            if any(use):
                device = state.lengths.device
                mixed = None if all(use) else torch.tensor(use, device=device)
                self._step = GivenDrafts(self.draft, torch.tensor(drafts, device=device), mixed, self.vocab_size)
        return self._step.propose(state, k, rows, generator, histories)

    def prefill(self, tokens, positions, lengths, first, target_hidden, cache_rows) -> Tensor | None:
        return self.draft.prefill(tokens, positions, lengths, first, target_hidden, cache_rows)

    def follow(self, state: DecodeState, out: StepOutput) -> Tensor | None:
        step, self._step = self._step, self.draft
        return step.follow(state, out)


class GivenDrafts:
    """Drafts found on the host (lookup first's, `LookupFirst.plan`) in `tokens` [B, K], which a CUDA graph of the
    step reads (written in before each replay). Rows that `use` [B] marks take them, the others the draft's (use
    None: every row takes them, and the draft does not run). The draft follows every step: an EAGLE-3 head reads
    the target's hidden states as after any step, and a draft model first reads the tokens the target read, which
    it did not all draft itself. (It proposes within steps only: the engine's draft reads the prompts.)"""

    reads_history = False

    def __init__(self, draft: "DraftModel | EagleProposer", tokens: Tensor, use: Tensor | None, vocab_size: int):
        self.draft, self.tokens, self.use, self.vocab_size = draft, tokens, use, vocab_size

    def propose(
        self, state: DecodeState, k: int, rows: RowSampling, generator: Random, histories: Sequence[Sequence[int]] = ()
    ) -> tuple[Tensor, Tensor | None]:
        given_q = one_hot_q(self.tokens, rows, self.vocab_size)
        if self.use is None:
            return self.tokens, given_q
        drafted, q = self.draft.propose(state, k, rows, generator, histories)
        tokens = torch.where(self.use.unsqueeze(1), self.tokens, drafted)
        return tokens, (None if q is None else torch.where(self.use.view(-1, 1, 1), given_q, q))

    def follow(self, state: DecodeState, out: StepOutput) -> Tensor | None:
        if isinstance(self.draft, DraftModel):
            self.draft.read(state, out)
        return self.draft.follow(state, out)
