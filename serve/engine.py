"""The engine: batched generation with or without a draft, over the runtime's models.

`Engine.generate` prefills a batch of prompts, then repeats speculative (K > 0) or plain steps until
every sequence has stopped. Finished rows stay in the batch, frozen, so that shapes (and CUDA
graphs) stay fixed.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import Tensor

from draftsmith.serve.device import DTYPES
from draftsmith.serve.eagle import EagleFormatError, EagleHead, check_fits, is_eagle_dir, load_head
from draftsmith.serve.graphs import GraphedForward, GraphedPrefill, GraphedSteps
from draftsmith.serve.model import Transformer
from draftsmith.serve.penalties import Penalties
from draftsmith.serve.proposers import DraftModel, EagleProposer, LookupFirst, PromptLookup, Proposer
from draftsmith.serve.rejection import Verifier, rejection_sample
from draftsmith.serve.sampling import Random, RowSampling, SamplingParams, probabilities, sample, to_device
from draftsmith.serve.speculative import DecodeState, StepOutput, decode_step
from draftsmith.serve.stats import SpecStats
from draftsmith.serve.stops import Detokenize, StopChecker
from draftsmith.serve.weights import load_model, read_config


def load_draft(
    path: Path, dtype: torch.dtype, device: str | torch.device, vocab: Sequence[int] | None = None, fallback: bool = False
) -> Transformer | EagleHead:
    """A draft dir: an EAGLE-3 head (speculators format) or a draft model, proposing from `vocab` if given;
    fallback: a draft model of a family the runtime does not implement runs in transformers (the pipeline's
    evaluate stage; serve/transformers_model.py)."""
    if is_eagle_dir(path):
        return load_head(path, dtype, device)
    if fallback:
        from draftsmith.serve.transformers_model import load_any

        draft = load_any(path, dtype, device)
    else:
        draft = load_model(path, dtype, device)
    if vocab is not None:
        draft.use_vocab(torch.tensor(list(vocab)))
    return draft


class EngineError(ValueError):
    """A request the engine cannot serve as asked (too long, too many, mismatched models)."""


@dataclass
class Logprobs:
    """The target's log-probabilities along a sequence: of each emitted token, and of the `top` most
    likely tokens at its position (ids, values)."""

    top: int = 0
    tokens: list[float] = field(default_factory=list)
    top_tokens: list[tuple[list[int], list[float]]] = field(default_factory=list)

    @classmethod
    def of(cls, params: SamplingParams) -> "Logprobs | None":
        """An empty record for a request that asked for log-probabilities, else None."""
        return cls(params.top_logprobs) if params.logprobs or params.top_logprobs else None

    def window(self, start: int, end: int) -> "Logprobs":
        """The entries of tokens start..end-1 (what a streamed chunk carries)."""
        return Logprobs(self.top, self.tokens[start:end], self.top_tokens[start:end])

    def add(self, logprobs: Tensor, tokens: list[int]) -> None:
        """logprobs [T, V] at the positions that emitted `tokens` (T of them)."""
        ids = torch.tensor(tokens, device=logprobs.device).unsqueeze(1)
        self.tokens += logprobs.gather(1, ids).squeeze(1).tolist()
        if self.top:
            values, top_ids = logprobs.topk(self.top, dim=-1)
            self.top_tokens += list(zip(top_ids.tolist(), values.tolist()))


@dataclass(frozen=True)
class Limits:
    """What requests must fit: the target's vocabulary, the cache's slots and the batch's rows (a process that
    holds no engine checks requests against its engine's limits with these)."""

    vocab_size: int
    max_seq_len: int
    max_batch_size: int

    def check(self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams], k: int, can_draft: bool) -> None:
        """EngineError for requests the engine cannot serve as asked."""
        if not prompts:
            raise EngineError("no prompts given")
        if len(prompts) > self.max_batch_size:
            raise EngineError(f"{len(prompts)} prompts exceed max_batch_size {self.max_batch_size}")
        if k > 0 and not can_draft:
            raise EngineError("num_speculative_tokens > 0 needs a draft model or another proposer")
        vocab = self.vocab_size
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            if not prompt:
                raise EngineError(f"prompt {i} is empty")
            if min(prompt) < 0 or max(prompt) >= vocab:
                raise EngineError(f"prompt {i} has token ids outside the vocabulary [0, {vocab})")
            if any(not 0 <= token < vocab for token, _ in p.logit_bias):
                raise EngineError(f"prompt {i}: logit_bias names token ids outside the vocabulary [0, {vocab})")
            if len(prompt) + p.max_new_tokens + k + 1 > self.max_seq_len:
                raise EngineError(
                    f"prompt {i}: {len(prompt)} prompt tokens + {p.max_new_tokens} new tokens "
                    f"+ {k + 1} speculative slots exceed max_seq_len {self.max_seq_len}"
                )


@dataclass
class Launched:
    """A step queued on the device, with its accepted counts and tokens on their way to host memory:
    the next step can be queued before this one's tokens are read, so that the device never waits for
    the host's stop checks and emission. `out` holds until the next step is launched."""

    out: StepOutput
    k: int
    host: Tensor  # [B, K+2]: each row's accepted draft count, then its K+1 tokens
    ready: "torch.cuda.Event | None" = None

    def read(self) -> tuple[list[int], list[list[int]]]:
        """Each row's accepted draft count and tokens (waits for this step only)."""
        if self.ready is not None:
            self.ready.synchronize()
        step = self.host.tolist()
        return [row[0] for row in step], [row[1:] for row in step]


@dataclass
class Completion:
    prompt_tokens: list[int]
    tokens: list[int]
    finish_reason: str
    text: str | None = None  # the text before a stop string, when one ended the sequence
    logprobs: Logprobs | None = None


@dataclass
class Generation:
    completions: list[Completion]
    stats: SpecStats = field(default_factory=SpecStats)
    target_steps: int = 0  # target steps whose tokens were kept (after prefill)
    seconds: float = 0.0

    @property
    def num_tokens(self) -> int:
        return sum(len(c.tokens) for c in self.completions)


def eos_ids_of(model_dir: Path) -> frozenset[int]:
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        path = model_dir / name
        if path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
            ids.update([eos] if isinstance(eos, int) else (eos or []))
    return frozenset(ids)


def detokenizer_of(model_dir: Path) -> Detokenize | None:
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path))
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


def make_proposer(
    target: Transformer,
    draft: Transformer | EagleHead | None,
    draft_forward: GraphedForward | None,
    fused: bool,
    draft_prefill: GraphedPrefill | None = None,
) -> Proposer | None:
    """A draft as a proposer; fused: with compiled forwards (inside whole-step graphs), else through
    `draft_forward` (a draft model's graphed forward); a draft model reads prompts through `draft_prefill`."""
    if draft is None:
        return None
    if isinstance(draft, EagleHead):
        return EagleProposer(draft, target.tok_embeddings, fused)
    forward = (lambda tokens, positions: draft(tokens, positions, fused=True)) if fused else draft_forward
    return DraftModel(draft, forward, target.args.vocab_size, draft_prefill)


class Engine:
    """Decoding over a target and, optionally, a draft: a small LM (Transformer) or an EAGLE-3 head."""

    def __init__(
        self,
        target: Transformer,
        draft: Transformer | EagleHead | None = None,
        *,
        max_batch_size: int = 1,
        max_seq_len: int = 2048,
        cuda_graphs: bool = True,
        compile_blocks: bool = True,
        eos_token_ids: frozenset[int] = frozenset(),
        detokenize: Detokenize | None = None,
        verify: Verifier = rejection_sample,
        overlap: bool | None = None,
    ):
        self.eagle = isinstance(draft, EagleHead)
        if self.eagle:
            try:
                check_fits(draft, target.args, "the EAGLE-3 head")
            except EagleFormatError as e:
                raise EngineError(str(e)) from None
        elif draft is not None and draft.args.vocab_size != target.args.vocab_size:
            raise EngineError(
                f"draft vocab size {draft.args.vocab_size} != target {target.args.vocab_size}: "
                "the draft must use the target's tokenizer (distill.draft.init=from_target does this)"
            )
        self.target, self.draft = target, draft
        self.device = target.output.weight.device
        cuda_graphs = cuda_graphs and all(model.graphable for model in (target, draft) if model is not None)
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len
        self.eos_token_ids, self.detokenize, self.verify = eos_token_ids, detokenize, verify
        # launch each step before reading the last one's tokens (Launched): on a GPU the host's work then
        # runs while the device computes; on a CPU, where a launch is the computation, it only adds a step
        self.overlap = self.device.type == "cuda" if overlap is None else overlap
        self._host_buffers: dict[tuple[int, ...], tuple[Tensor, torch.cuda.Event]] = {}
        self._launches = 0
        self.caches = []  # each model's cache of this engine's: another engine over the same models makes its own
        for model in (target, draft):
            if model is not None:
                model.requires_grad_(False)  # any path, not only inference-mode ones, builds no autograd graph
                self.caches.append((model, model.setup_cache(max_batch_size, max_seq_len)))
        self.hidden_layers = draft.aux_layers if self.eagle else ()  # what the target hands an EAGLE-3 head
        self.target_forward = GraphedForward(target, cuda_graphs, compile_blocks, hidden_layers=self.hidden_layers)
        self.draft_forward = GraphedForward(draft, cuda_graphs, compile_blocks) if draft is not None and not self.eagle else None
        # a joining request's prefill holds up every running row: the draft model's runs as a graph too
        self.draft_prefill = GraphedPrefill(draft, (), cuda_graphs) if self.draft_forward is not None else None
        if self.eagle and self.target_forward.enabled and compile_blocks:
            draft.compile_layers()
        self.draft_proposer = self.proposer()
        # and an EAGLE-3 head's, after the target's: it reads the target's hidden states in place
        self.target_prefill = GraphedPrefill(
            target, self.hidden_layers, cuda_graphs, head=self.draft_proposer.prefill if self.eagle else None
        )
        # greedy steps with the engine's draft (or plain) run as one graph each; the rest forward by forward.
        # The graphs' proposer factory holds no reference to the engine: a dropped engine frees its graphs
        # at once rather than at a garbage collection, which must not come during another engine's capture
        self.step_graphs = (
            GraphedSteps(target, self.hidden_layers, partial(make_proposer, target, draft, None, True), self.draft_hidden_size)
            if self.target_forward.enabled
            else None
        )

    def activate(self) -> None:
        """Put this engine's caches back in its models (another engine over them may have set up its own
        since): what its CUDA graphs were captured on, at the sizes it was made for."""
        for model, state in self.caches:
            model.use_cache(state)

    @property
    def draft_hidden_size(self) -> int | None:
        """The width of DecodeState.draft_hidden: an EAGLE-3 head keeps one hidden state per row."""
        return self.draft.args.hidden_size if self.eagle else None

    def proposer(self, fused: bool = False) -> Proposer | None:
        """The engine's draft as a proposer; fused: with compiled forwards (inside whole-step graphs)."""
        return make_proposer(self.target, self.draft, self.draft_forward, fused, self.draft_prefill)

    def idle_state(self, batch: int) -> DecodeState:
        """Rows parked past the cache's end (DecodeState.idle), with the draft's hidden state if it keeps one."""
        return DecodeState.idle(batch, self.max_seq_len + 1, self.device, self.draft_hidden_size, self.target.output.weight.dtype)

    @classmethod
    def load(
        cls,
        target_dir: str | Path,
        draft_dir: str | Path | None = None,
        *,
        dtype: str = "bfloat16",
        device: str = "cpu",
        draft_vocab: Sequence[int] | None = None,
        **kwargs,
    ) -> "Engine":
        """An engine over HF model dirs (the tokenizer and EOS ids come from the target's dir). The draft
        dir holds a draft model or an EAGLE-3 head (speculators format); draft_vocab: the token ids a
        draft model proposes from (None: all)."""
        target_dir = Path(target_dir)
        target = load_model(target_dir, DTYPES[dtype], device)
        draft = load_draft(Path(draft_dir), DTYPES[dtype], device, draft_vocab) if draft_dir is not None else None
        kwargs.setdefault("max_seq_len", min(2048, read_config(target_dir).get("max_position_embeddings", 2048)))
        return cls(target, draft, eos_token_ids=eos_ids_of(target_dir), detokenize=detokenizer_of(target_dir), **kwargs)

    @property
    def limits(self) -> "Limits":
        return Limits(self.target.args.vocab_size, self.max_seq_len, self.max_batch_size)

    @torch.inference_mode()
    def prefill(
        self, prompts: Sequence[Sequence[int]], rows: RowSampling, generator, cache_rows: Tensor | None = None
    ) -> tuple[DecodeState, Tensor]:
        """Both models read the prompts into their caches (rows 0..B-1, or `cache_rows`); the state holds
        each row's first token, drawn from the target's last logits [B, V] (returned too)."""
        self.activate()
        B, longest = len(prompts), max(len(p) for p in prompts)
        padded = torch.zeros(B, longest, dtype=torch.long)
        for i, prompt in enumerate(prompts):
            padded[i, : len(prompt)] = torch.tensor(prompt)
        tokens = to_device(padded, self.device)  # one copy to the device
        positions = torch.arange(longest, device=self.device).expand(B, longest)  # padding lands past each length
        lengths = to_device([len(p) for p in prompts], self.device)
        if cache_rows is None:
            cache_rows = torch.arange(B, device=self.device)
        # last [B, V]: the logits after each prompt's last token; hidden states at every position [B, T, F]
        last, hidden = self.target_prefill(tokens, positions, lengths, cache_rows)
        first = sample(probabilities(rows.penalised(last.unsqueeze(1)), rows), generator).squeeze(1)  # [B]
        # the draft reads them too; an EAGLE-3 head replays with the target's prompt graph, over its hidden states
        read = self.target_prefill.read_head if self.eagle else self.draft_proposer.prefill if self.draft_proposer else None
        draft_hidden = read(tokens, positions, lengths, first, hidden, cache_rows) if read else None
        previous = tokens.gather(1, (lengths - 1).unsqueeze(1)).squeeze(1)
        text = torch.zeros(B, self.max_seq_len + 2, dtype=torch.long, device=self.device)  # as wide as idle_state's
        text[:, :longest] = tokens
        text.scatter_(1, lengths.unsqueeze(1), first.unsqueeze(1))
        return DecodeState(lengths=lengths, pending=first, previous=previous, draft_hidden=draft_hidden, text=text), last

    @torch.inference_mode()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
        num_speculative_tokens: int = 0,
        proposer: Proposer | None = None,
        on_tokens: Callable[[int, list[int]], None] | None = None,
    ) -> Generation:
        """Generate for each prompt; K = num_speculative_tokens (0: plain decoding with the target),
        proposed by `proposer` (default: the draft model). on_tokens(row, tokens) hears each row's
        tokens as they are kept, for streaming."""
        k = num_speculative_tokens
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        proposer = proposer or self.draft_proposer
        self.limits.check(prompts, params, k, proposer is not None)
        started = time.perf_counter()
        rows = RowSampling.of(params, self.device)
        rows.penalties = Penalties.of(params, prompts, self.target.args.vocab_size, self.device)
        seed = params[0].seed
        generator = torch.Generator(self.device).manual_seed(seed) if seed is not None else None
        stops = [StopChecker(p, self.eos_token_ids, self.detokenize) for p in params]
        logprobs = [Logprobs.of(p) for p in params]

        state, first_logits = self.prefill(prompts, rows, generator)
        if rows.penalties is not None:  # the first token is output: the steps' penalties count it
            rows.penalties.record_first(state.pending)
        self.emit_first(state, first_logits, stops, logprobs, on_tokens)
        active_rows = [stop.finish_reason is None for stop in stops]
        active = to_device(active_rows, self.device)
        generation = Generation(completions=[])
        reads_history = k > 0 and proposer.reads_history
        # a step's tokens are read while the next one runs, unless the next step needs them (lookup first
        # reads the history on the host) or the target's logits are wanted (the next step rewrites them)
        ahead = self.overlap and not reads_history and not any(logprobs)
        in_flight: Launched | None = None
        while any(active_rows):
            histories = [list(p) + s.tokens for p, s in zip(prompts, stops)] if reads_history else []
            launched = self.launch(state, active, k, rows, generator, proposer, histories)
            for done in ([in_flight] if in_flight else []) + ([] if ahead else [launched]):
                self.emit(done, active_rows, stops, logprobs, generation.stats, on_tokens)
                generation.target_steps += 1
            in_flight = launched if ahead else None  # the last one, launched before the rows stopped, goes unread
            still = [a and stop.finish_reason is None for a, stop in zip(active_rows, stops)]
            if still != active_rows:
                active_rows, active = still, to_device(still, self.device)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        generation.seconds = time.perf_counter() - started
        generation.completions = [
            Completion(list(p), s.tokens, s.finish_reason or "length", s.text, lp) for p, s, lp in zip(prompts, stops, logprobs)
        ]
        return generation

    def step(
        self,
        state: DecodeState,
        active: Tensor,
        k: int,
        rows: RowSampling,
        generator: Random,
        proposer: Proposer | None,
        histories: Sequence[Sequence[int]] = (),
    ) -> StepOutput:
        """One decoding step (K = 0: plain); the `active` rows of `state` advance in place. The output's
        tensors hold until the next step."""
        self.activate()
        graphed = self.step_graphs is not None and rows.all_greedy and rows.penalties is None
        lookup_first = isinstance(proposer, LookupFirst) and proposer.draft is self.draft_proposer
        if graphed and k and (isinstance(proposer, PromptLookup) or lookup_first and proposer.on_device):
            return self.step_graphs(state, active, k, lookup=proposer)  # the rows' text searched in the step's graph
        if graphed and k and lookup_first:
            drafts, use = proposer.plan(histories, k)
            if any(use):  # the lookup's drafts where they are taken (every row: the draft does not run)
                return self.step_graphs(state, active, k, to_device(drafts, self.device), None if all(use) else to_device(use, self.device))
            proposer = self.draft_proposer
        if graphed and (k == 0 or proposer is self.draft_proposer):
            return self.step_graphs(state, active, k)
        return decode_step(self.target_forward, proposer, state, active, k, rows, generator, self.verify, histories)

    def launch(
        self,
        state: DecodeState,
        active: Tensor,
        k: int,
        rows: RowSampling,
        generator: Random,
        proposer: Proposer | None,
        histories: Sequence[Sequence[int]] = (),
    ) -> Launched:
        """`step`, with its accepted counts and tokens copied to host memory as the device finishes it."""
        out = self.step(state, active, k, rows, generator, proposer, histories)
        both = torch.cat([out.num_accepted.unsqueeze(1).to(out.tokens.dtype), out.tokens], dim=1)
        if self.device.type != "cuda":
            return Launched(out, k, both)
        # two pinned buffers per shape, taken in turn: at most two steps are out at once, and buffers made
        # per step would be freed (an event recorded) at garbage-collection times, a graph capture among them
        self._launches += 1
        key = (*both.shape, self._launches % 2)
        if key not in self._host_buffers:
            self._host_buffers[key] = torch.empty(both.shape, dtype=both.dtype, pin_memory=True), torch.cuda.Event()
        host, ready = self._host_buffers[key]
        host.copy_(both, non_blocking=True)
        ready.record()
        return Launched(out, k, host, ready)

    @torch.inference_mode()
    def time_steps(self, batch: int, ks: Sequence[int], rounds: int = 5, proposer: Proposer | None = None) -> dict[int, float]:
        """Milliseconds of one greedy step at `batch` rows for each K in `ks` (0: plain), with `proposer`
        (default: the engine's draft), on idle rows (nothing moves). The Ks are timed in turns, `rounds` times
        each, and each keeps its fastest: another job on the device slows every K alike rather than the ones
        timed while it ran, and it can only add time. A first, untimed step of each K warms up (on a GPU it
        captures the step's graph). A proposer that reads each row's text on the host (lookup first) searches random
        texts half the cache long, as long as 1,024 tokens: on one token its host search cost nothing, and adaptive
        K kept a lookup at batch 16 that decoded at 0.56x plain (H100, 2026-12-05)."""
        state, active = self.idle_state(batch), torch.zeros(batch, dtype=torch.bool, device=self.device)
        rows = RowSampling.of([SamplingParams()] * batch, self.device)
        proposer = proposer or self.draft_proposer
        histories = self.timing_texts(batch) if proposer is not None and proposer.reads_history else []
        times: dict[int, list[float]] = {k: [] for k in ks}
        for i in range(rounds + 1):
            for k in ks:
                if self.device.type == "cuda":
                    torch.cuda.synchronize()
                started = time.perf_counter()
                self.step(state, active, k, rows, None, proposer, histories)
                if self.device.type == "cuda":
                    torch.cuda.synchronize()
                if i:
                    times[k].append((time.perf_counter() - started) * 1000)
        return {k: min(ms) for k, ms in times.items()}

    def timing_texts(self, batch: int) -> list[list[int]]:
        """Random token texts for timing a proposer that searches each row's text (few repeats: a near-full scan)."""
        g = torch.Generator().manual_seed(0)
        length = max(2, min(self.max_seq_len // 2, 1024))
        return torch.randint(0, self.target.args.vocab_size, (batch, length), generator=g).tolist()

    @staticmethod
    def emit_first(
        state: DecodeState,
        last: Tensor,
        stops: list[StopChecker],
        logprobs: list[Logprobs | None],
        on_tokens: Callable[[int, list[int]], None] | None,
    ) -> None:
        """Hand each prefilled row its first token (stops, logprobs from the target's `last` logits [B, V],
        on_tokens)."""
        first = state.pending.tolist()
        for i, stop in enumerate(stops):
            if stop.append([first[i]]):
                if logprobs[i] is not None:
                    logprobs[i].add(last[i : i + 1].float().log_softmax(-1), [first[i]])
                if on_tokens:
                    on_tokens(i, [first[i]])

    def emit(
        self,
        launched: Launched,
        active_rows: list[bool],
        stops: list[StopChecker],
        logprobs: list[Logprobs | None],
        stats: SpecStats,
        on_tokens: Callable[[int, list[int]], None] | None,
    ) -> list[int]:
        """Hand each active row its kept tokens (stops, logprobs, on_tokens) and count the step;
        returns each row's accepted draft count. Logprobs read the step's target logits: emit a step
        that has rows wanting them before the next step is launched."""
        num_accepted, tokens = launched.read()
        wanted = any(lp is not None and a for lp, a in zip(logprobs, active_rows))
        target_logprobs = launched.out.target_logits.float().log_softmax(-1) if wanted else None  # [B, K+1, V]
        if launched.k > 0:
            stats.record(launched.k, [n for n, a in zip(num_accepted, active_rows) if a])
        for i, stop in enumerate(stops):
            if not active_rows[i]:
                continue
            kept = stop.append(tokens[i][: num_accepted[i] + 1])
            if target_logprobs is not None and logprobs[i] is not None and kept:
                logprobs[i].add(target_logprobs[i, :kept], tokens[i][:kept])
            if on_tokens and kept:
                on_tokens(i, tokens[i][:kept])
        return num_accepted
