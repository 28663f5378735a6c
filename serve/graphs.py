"""CUDA graphs for the runtime: captured on first use of each shape.

At this model size launch overhead, not memory bandwidth, bounds a decode step; replaying a graph
launches all its kernels at once. `GraphedForward` captures one model forward per (batch, tokens)
shape. `GraphedSteps` captures a whole greedy step per (batch, K): the draft's K proposals (or prompt
lookup's, searched on the device, or lookup first's, found on the host and copied in), the target's
forward over K+1 tokens, acceptance, an EAGLE-3 head's catch-up and the state's advance, with no gap
between kernels and no Python in between; the one sync left is reading the step's tokens. On CPU (or
with graphs off) the same calls run eagerly. `GraphedPrefill` replays the target's prompt forward
(prefill) per (batch, length) bucket, and an EAGLE-3 head's after it.
"""

from __future__ import annotations

import gc
from typing import Callable

import torch
from torch import Tensor

from draftsmith.serve.model import Transformer
from draftsmith.serve.proposers import GivenDrafts, LookupFirst, PromptLookup, Proposer
from draftsmith.serve.sampling import RowSampling, SamplingParams
from draftsmith.serve.speculative import DecodeState, StepOutput, TargetForward, decode_step

# a step graph's drafts: "draft", "given", "mixed", ("lookup", max_ngram, min_ngram) or ("lookup first", max_ngram, min_match)
Drafted = str | tuple[str, int, int]


def bucket(n: int, limit: int) -> int:
    """The next power of two from n, at most `limit`: the few shapes that graphs are captured for."""
    size = 1
    while size < n:
        size *= 2
    return min(size, limit)


def target_forward(model: Transformer, hidden_layers: tuple[int, ...], fused: bool = False) -> TargetForward:
    """The target's forward as decoding steps call it: (logits, hidden states entering `hidden_layers` or None)."""
    if hidden_layers:
        return lambda tokens, positions: model(tokens, positions, fused=fused, hidden_layers=hidden_layers)
    return lambda tokens, positions: (model(tokens, positions, fused=fused), None)


def record_graph(fn: Callable[[], object], pool) -> tuple[torch.cuda.CUDAGraph, object]:
    """Run fn twice on a side stream (allocations settle, compiled code is built for the shapes), then
    record it as a graph; returns the graph and fn's output tensors, which every replay rewrites."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # no garbage collection during the capture: a graph freed by it (a dropped engine's, held in a reference
    # cycle) resets on a capturing stream, which invalidates the capture
    collecting = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool):
            out = fn()
    finally:
        if collecting:
            gc.enable()
    return graph, out


class GraphedForward:
    """A model's forward, replayed from a CUDA graph per (batch, tokens) shape. A draft's returns logits;
    a target's (hidden_layers given, maybe empty) returns what `target_forward` does."""

    def __init__(
        self,
        model: Transformer,
        enabled: bool = True,
        compile_blocks: bool = True,
        max_tokens: int = 16,
        hidden_layers: tuple[int, ...] | None = None,
    ):
        self.model = model
        device = model.output.weight.device
        self.enabled = enabled and device.type == "cuda"
        if self.enabled and compile_blocks:  # graphs remove launch gaps; compiling removes launches
            model.compile_blocks()
        self.max_tokens = max_tokens  # longer inputs (prefill) run eagerly
        is_target = hidden_layers is not None
        self.eager = target_forward(model, hidden_layers) if is_target else model
        self.fused = target_forward(model, hidden_layers, fused=True) if is_target else lambda t, p: model(t, p, fused=True)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, Tensor, Tensor, object]] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.enabled else None

    @torch.inference_mode()
    def __call__(self, tokens: Tensor, positions: Tensor):
        B, T = tokens.shape
        if not self.enabled or T > self.max_tokens:
            return self.eager(tokens, positions)
        entry = self.graphs.get((B, T)) or self._capture(B, T, tokens.device)
        graph, static_tokens, static_positions, static_out = entry
        static_tokens.copy_(tokens)
        static_positions.copy_(positions)
        graph.replay()
        return static_out

    def _capture(self, B: int, T: int, device: torch.device):
        static_tokens = torch.zeros(B, T, dtype=torch.long, device=device)
        # warm-up and capture write the cache's spare slot only
        static_positions = torch.full((B, T), self.model.max_seq_len, dtype=torch.long, device=device)
        graph, static_out = record_graph(lambda: self.fused(static_tokens, static_positions), self.pool)
        self.graphs[(B, T)] = (graph, static_tokens, static_positions, static_out)
        return self.graphs[(B, T)]


class GraphedSteps:
    """Greedy decoding steps as CUDA graphs, one per (batch, K, drafts); K = 0 is a plain step. `proposer()`
    makes the engine's proposer with compiled forwards (None without a draft). Drafts found on the host (lookup
    first's) are copied into the graph's own buffers (serve.proposers.GivenDrafts) before it replays, for every
    row (the draft reads the step after) or only the rows `use` marks (the draft drafts the others). Prompt
    lookup, and lookup first on the device (`lookup`), search the rows' text inside the graph."""

    def __init__(
        self, target: Transformer, hidden_layers: tuple[int, ...], proposer: Callable[[], Proposer | None], hidden_size: int | None = None
    ):
        self.target, self.hidden_layers, self.proposer, self.hidden_size = target, hidden_layers, proposer, hidden_size
        self.graphs: dict[tuple[int, int, Drafted], tuple[torch.cuda.CUDAGraph, DecodeState, Tensor, Proposer | None, StepOutput]] = {}
        self.pool = torch.cuda.graph_pool_handle()

    @torch.inference_mode()
    def __call__(
        self,
        state: DecodeState,
        active: Tensor,
        k: int,
        drafts: Tensor | None = None,
        use: Tensor | None = None,
        lookup: PromptLookup | LookupFirst | None = None,
    ) -> StepOutput:
        """The step's output (rewritten by the next replay); `state` advances in place. drafts [B, K]: the
        host's, taken where `use` [B] is True (None: every row); lookup: one that searches the rows' text on the
        device (prompt lookup, or lookup first on_device over the engine's draft) drafts instead."""
        drafted: Drafted = "draft" if drafts is None else "mixed" if use is not None else "given"
        if isinstance(lookup, PromptLookup):
            drafted = ("lookup", lookup.max_ngram, lookup.min_ngram)
        elif lookup is not None:
            drafted = ("lookup first", lookup.max_ngram, lookup.min_match)
        key = (len(active), k, drafted)
        graph, static_state, static_active, proposer, out = self.graphs.get(key) or self.capture(*key)
        static_state.copy_(state)
        static_active.copy_(active)
        if drafts is not None:
            proposer.tokens.copy_(drafts)
        if use is not None:
            proposer.use.copy_(use)
        graph.replay()
        state.copy_(static_state)
        return out

    @torch.inference_mode()
    def capture(self, batch: int, k: int, drafted: Drafted = "draft"):
        weight = self.target.output.weight
        # warm-up and capture run inactive rows past the cache's end: every write lands in the spare slot
        # (positions clamp to it, the draft's re-read of `previous` included) and the state stays put
        state = DecodeState.idle(batch, self.target.max_seq_len + 1, weight.device, self.hidden_size, weight.dtype)
        active = torch.zeros(batch, dtype=torch.bool, device=weight.device)
        rows = RowSampling.of([SamplingParams()] * batch, weight.device)  # greedy: no generator, no distributions
        target = target_forward(self.target, self.hidden_layers, fused=True)
        name, max_ngram, least = drafted if isinstance(drafted, tuple) else (drafted, 0, 0)
        vocab_size = self.target.args.vocab_size
        if name == "lookup":  # the rows' text searched inside the graph
            proposer: Proposer | None = PromptLookup(vocab_size, max_ngram, least)
        elif name == "lookup first":  # so too, the draft drafting the rows without a match
            proposer = LookupFirst(self.proposer(), vocab_size, least, max_ngram, on_device=True)
        else:
            proposer = self.proposer()
        if drafted in ("given", "mixed"):
            tokens = torch.zeros(batch, k, dtype=torch.long, device=weight.device)
            use = torch.zeros(batch, dtype=torch.bool, device=weight.device) if drafted == "mixed" else None
            proposer = GivenDrafts(proposer, tokens, use, vocab_size)
        graph, out = record_graph(lambda: decode_step(target, proposer, state, active, k, rows, None), self.pool)
        self.graphs[(batch, k, drafted)] = (graph, state, active, proposer, out)
        return self.graphs[(batch, k, drafted)]


class GraphedPrefill:
    """The target's prompt forward, replayed from a CUDA graph per (batch, length) bucket. Run eagerly it
    launches thousands of kernels (~35 ms on an H200 for the demo target's 30 layers, for a few ms of
    device work), and every running row waits for a joining request's prefill. Padding rows read
    positions past the cache's end (their writes land in the spare slot); a prompt padded to the
    bucket's length writes past its own end, positions that decoding rewrites before they are read.
    Shapes of more than `max_tokens` tokens run eagerly, where the device's work outweighs the launches.
    An EAGLE-3 head's prompt read (`head`: EagleProposer.prefill) follows the target's in a graph of its own
    per bucket (`read_head`): eagerly it is ~150 small kernels an admission, launched while rows wait."""

    MIN_LENGTH = 16

    def __init__(
        self,
        model: Transformer,
        hidden_layers: tuple[int, ...],
        enabled: bool,
        max_tokens: int = 8192,
        head: Callable[..., Tensor] | None = None,
    ):
        self.model, self.hidden_layers, self.max_tokens, self.head = model, hidden_layers, max_tokens, head
        self.enabled = enabled and model.output.weight.device.type == "cuda"
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, dict[str, Tensor], object]] = {}
        self.head_graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, Tensor, Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.enabled else None

    def shape(self, batch: int, length: int) -> tuple[int, int] | None:
        """The bucket a prefill of `batch` prompts of up to `length` tokens replays, or None (eager)."""
        shape = (bucket(batch, self.model.max_batch_size), bucket(max(length, self.MIN_LENGTH), 1 << 30))
        fits = shape[1] <= self.model.max_seq_len and shape[0] * shape[1] <= self.max_tokens
        return shape if self.enabled and fits else None

    @torch.inference_mode()
    def __call__(self, tokens: Tensor, positions: Tensor, lengths: Tensor, cache_rows: Tensor) -> tuple[Tensor, Tensor | None]:
        """tokens [B, T] (prompts right-padded), positions [B, T] (0..T-1 in each row), lengths [B],
        cache_rows [B] -> the logits after each prompt's last token [B, V] and, for an EAGLE-3 head, the
        hidden states [B, T, F]."""
        B, T = tokens.shape
        shape = self.shape(B, T)
        if shape is None:
            out = self.model(
                tokens, positions, logits_at=(lengths - 1).unsqueeze(1), cache_rows=cache_rows, hidden_layers=self.hidden_layers
            )
            last, hidden = out if self.hidden_layers else (out, None)
            return last[:, 0], hidden
        graph, static, out = self.graphs.get(shape) or self.capture(*shape)
        static["tokens"].zero_()
        static["tokens"][:B, :T] = tokens
        static["positions"].fill_(self.model.max_seq_len)  # padding rows: the spare slot
        static["positions"][:B] = torch.arange(shape[1], device=tokens.device)
        static["logits_at"].zero_()
        static["logits_at"][:B, 0] = lengths - 1
        static["cache_rows"].copy_(cache_rows[:1].expand(shape[0]))  # padding rows write a real row's spare slot
        static["cache_rows"][:B] = cache_rows
        graph.replay()
        last, hidden = out if self.hidden_layers else (out, None)
        return last[:B, 0].clone(), None if hidden is None else hidden[:B, :T]

    @torch.inference_mode()
    def read_head(self, tokens: Tensor, positions: Tensor, lengths: Tensor, first: Tensor, hidden: Tensor, cache_rows: Tensor) -> Tensor:
        """The head reads the prompts that this prefill's last call read (`first` [B]: the tokens sampled
        after them, `hidden` its hidden states); returns the head's hidden state at each prompt's end [B, H].
        A replayed prefill's head read replays too, over that prefill's inputs and outputs in place."""
        B, T = tokens.shape
        shape = self.shape(B, T)
        if shape is None:
            return self.head(tokens, positions, lengths, first, hidden, cache_rows)
        graph, static_first, out = self.head_graphs.get(shape) or self.capture_head(*shape)
        static_first[:B] = first
        graph.replay()
        return out[:B].clone()

    @torch.inference_mode()
    def capture_head(self, batch: int, length: int) -> tuple[torch.cuda.CUDAGraph, Tensor, Tensor]:
        _, static, (_, hidden) = self.graphs.get((batch, length)) or self.capture(batch, length)
        first = torch.zeros(batch, dtype=torch.long, device=hidden.device)
        read = lambda: self.head(static["tokens"], static["positions"], static["logits_at"][:, 0] + 1, first, hidden, static["cache_rows"])
        graph, out = record_graph(read, self.pool)  # run before its capture: a real prefill's rows are read again by the replay
        self.head_graphs[(batch, length)] = (graph, first, out)
        return self.head_graphs[(batch, length)]

    def capture_all(self, batch: int) -> None:
        """Capture every length bucket that a prefill of `batch` prompts replays (a warm-up's work)."""
        length = self.MIN_LENGTH
        while (shape := self.shape(batch, length)) is not None:
            if shape not in self.graphs:
                self.capture(*shape)
            if self.head is not None and shape not in self.head_graphs:
                self.capture_head(*shape)
            length *= 2

    @torch.inference_mode()
    def capture(self, batch: int, length: int):
        device = self.model.output.weight.device
        static = {
            "tokens": torch.zeros(batch, length, dtype=torch.long, device=device),
            "positions": torch.full((batch, length), self.model.max_seq_len, dtype=torch.long, device=device),
            "logits_at": torch.zeros(batch, 1, dtype=torch.long, device=device),
            "cache_rows": torch.zeros(batch, dtype=torch.long, device=device),
        }
        # warm-up and capture write the spare slot of cache row 0 only
        graph, out = record_graph(
            lambda: self.model(
                static["tokens"],
                static["positions"],
                logits_at=static["logits_at"],
                cache_rows=static["cache_rows"],
                hidden_layers=self.hidden_layers,
            ),
            self.pool,
        )
        self.graphs[(batch, length)] = (graph, static, out)
        return self.graphs[(batch, length)]
