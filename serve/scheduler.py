"""Continuous batching: requests join free rows of the engine's batch between steps and leave when done.

Each step runs the occupied rows (the prefix up to the highest busy row, rounded up to a power of two
so that CUDA graphs are captured for a few shapes only), speculative or plain. With adaptive K the
step's K is the one with the most expected tokens per second, from each running request's own
acceptance (Acceptance: its estimate of alpha from what the target kept of its drafts) and the step costs measured
at warm-up for that batch size; K = 0 (plain decoding) when no K beats it, with a probe every
`PROBE_EVERY` plain steps so that a request's acceptance can recover. Every step is the engine's own
speculative or plain step, so output stays exactly the target's.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from draftsmith.serve.engine import Completion, Engine, EngineError, Launched, Logprobs
from draftsmith.serve.graphs import bucket
from draftsmith.serve.penalties import Penalties
from draftsmith.serve.proposers import Proposer
from draftsmith.serve.sampling import Random, RowGenerators, RowSampling, SamplingParams, to_device
from draftsmith.serve.speculative import DecodeState
from draftsmith.serve.stats import SpecStats, expected_tokens
from draftsmith.serve.stops import StopChecker

log = logging.getLogger("draftsmith")


def _memory(device: torch.device) -> str:
    return f", {torch.cuda.memory_allocated(device) / 2**30:.1f} GiB allocated" if device.type == "cuda" else ""


PROBE_EVERY = 16  # plain steps between speculative probes when adaptive K has turned speculation off
SMOOTHING = 0.2  # how much of a request's acceptance record each step forgets
PRIOR_WEIGHT = 2.0  # drafts' worth of evidence that the prior alpha counts for
IDLE = SamplingParams()  # what an empty row of the batch "samples" with (greedy; its output is dropped)


@dataclass
class Request:
    prompt: list[int]
    params: SamplingParams
    on_tokens: Callable[[list[int]], None] = lambda tokens: None  # kept tokens, in order, as they come
    on_done: Callable[["Completion | BaseException"], None] = lambda result: None
    cancelled: threading.Event = field(default_factory=threading.Event)  # set by a client that went away
    submitted: float = field(default_factory=time.perf_counter)
    stats: SpecStats = field(default_factory=SpecStats)
    logprobs: Logprobs | None = None  # the target's log-probabilities of its kept tokens, when asked for: each
    # token's entry is there before on_tokens hears the token


@dataclass
class Acceptance:
    """A request's draft acceptance rate alpha: the chance that the target keeps a draft token, given that
    it kept the ones before. A step of K drafts with `a` kept tried a + 1 drafts (the first one refused)
    when a < K, and K when all were kept: alpha's estimate is kept / tried, over decaying sums that start
    from the prior. (The fraction kept, a / K, is no estimate of it: with alpha 0.8 and K = 7 it is 0.45.)"""

    kept: float
    tried: float

    @classmethod
    def prior(cls, alpha: float) -> "Acceptance":
        return cls(alpha * PRIOR_WEIGHT, PRIOR_WEIGHT)

    @property
    def alpha(self) -> float:
        return self.kept / self.tried

    def record(self, k: int, kept: int) -> None:
        self.kept = (1 - SMOOTHING) * self.kept + kept
        self.tried = (1 - SMOOTHING) * self.tried + kept + (kept < k)


@dataclass
class Running:
    request: Request
    stop: StopChecker
    acceptance: Acceptance
    generator: torch.Generator | None = None  # the request's own, when it gave a seed


@dataclass
class Prefilled:
    """Requests read into rows of the batch, ready to join it."""

    requests: list[Request]
    rows: list[int]
    stops: list[StopChecker]
    generators: dict[int, torch.Generator]  # by index into requests: those that gave a seed
    state: DecodeState
    last: torch.Tensor  # the target's logits after each prompt [B, V]
    penalties: Penalties | None


@dataclass
class StepCostTable:
    """Milliseconds per whole greedy step on this device, by (batch size, K); K = 0 is a plain step."""

    step_ms: dict[tuple[int, int], float]

    def best_k(self, batch: int, alphas: list[float], max_k: int) -> int:
        """The K (0..max_k) with the most expected tokens per millisecond for these rows."""
        rate = lambda k: sum(expected_tokens(a, k) for a in alphas) / self.step_ms[(batch, k)]
        return max(range(max_k + 1), key=rate)  # ties go to the smaller K


class Scheduler:
    def __init__(
        self,
        engine: Engine,
        num_speculative_tokens: int,
        adaptive: bool = True,
        prior_alpha: float = 0.5,
        seed: int | None = None,
        on_step: Callable[[int, list[int]], None] = lambda k, accepted: None,
        proposer: Proposer | None = None,
    ):
        """proposer: what drafts (default: the engine's draft model or head; lookup first reads each row's
        text so far on the host, so its steps are handed out before the next launch)."""
        self.proposer = proposer or engine.draft_proposer
        if num_speculative_tokens > 0 and self.proposer is None:
            raise EngineError("num_speculative_tokens > 0 needs an engine with a draft model")
        self.engine, self.max_k, self.adaptive, self.prior_alpha = engine, num_speculative_tokens, adaptive, prior_alpha
        self.on_step = on_step  # (K, accepted drafts per row; [] when K = 0) after every step: metrics
        self.generator = torch.Generator(engine.device).manual_seed(seed) if seed is not None else None
        size = engine.max_batch_size
        self.rows: list[Running | None] = [None] * size
        self.state = engine.idle_state(size)  # empty rows sit past the cache's end until a request joins
        self.waiting: deque[Request] = deque()
        self.costs: StepCostTable | None = None
        self.plain_steps = 0
        self.wake = threading.Condition()
        self._sampling: tuple[tuple, RowSampling] | None = None
        self.penalties: Penalties | None = None  # every row's, once a request with penalties has joined
        self._mask: tuple[tuple[bool, ...], torch.Tensor] | None = None
        self.in_flight: tuple[Launched, list[Running | None]] | None = None  # launched, its tokens not yet handed out
        self.joined: list[Prefilled] = []  # prefilled into rows, their first tokens not yet handed out

    # -- the caller's side (any thread) -----------------------------------------------------------
    def submit(self, request: Request) -> None:
        """Queue a request; EngineError (too long, ids outside the vocabulary) is raised here, at once."""
        self.engine.limits.check([request.prompt], [request.params], self.max_k, self.proposer is not None)
        with self.wake:
            self.waiting.append(request)
            self.wake.notify()

    @property
    def num_running(self) -> int:
        return sum(r is not None for r in self.rows)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # -- the engine's thread ----------------------------------------------------------------------
    def warm_up(self, full: bool = True, batch_sizes: Sequence[int] | None = None) -> None:
        """Time a whole greedy step at every batch bucket (or those of `batch_sizes`) and K = 0..max (on a
        GPU this captures each step's CUDA graph) before any request is admitted; a bucket left out is timed
        when a step first needs it. full: also capture what sampled steps and prompt prefills replay."""
        e = self.engine
        sizes = range(1, e.max_batch_size + 1) if batch_sizes is None else batch_sizes
        buckets = sorted({bucket(n, e.max_batch_size) for n in sizes})
        self.costs = StepCostTable({})
        started = time.perf_counter()
        for b in buckets:
            self._time_steps(b)
            costs = ", ".join(f"K={k} {self.costs.step_ms[(b, k)]:.2f}" for k in range(self.max_k + 1))
            log.info("warm-up: steps at batch %d timed, ms: %s (%.0f s%s)", b, costs, time.perf_counter() - started, _memory(e.device))
        if full and e.target_forward.enabled:  # sampled steps run forward by forward: capture those shapes too
            tokens = lambda b, t: torch.zeros(b, t, dtype=torch.long, device=e.device)
            for b in buckets:
                for t in range(1, self.max_k + 2):
                    e.target_forward(tokens(b, t), tokens(b, t) + e.max_seq_len)
                if e.draft_forward is not None and self.max_k > 0:
                    for t in (1, 2):  # a draft model's first forward of a step reads 2 tokens
                        e.draft_forward(tokens(b, t), tokens(b, t) + e.max_seq_len)
                for prefill in (e.target_prefill, e.draft_prefill):
                    if prefill is not None:
                        prefill.capture_all(b)
                log.info(
                    "warm-up: batch %d's sampled forwards and prefills captured (%.0f s%s)",
                    b,
                    time.perf_counter() - started,
                    _memory(e.device),
                )

    def _time_steps(self, batch: int) -> None:
        timed = self.engine.time_steps(batch, range(self.max_k + 1), proposer=self.proposer)
        self.costs.step_ms.update({(batch, k): ms for k, ms in timed.items()})

    def serve_forever(self, stop: threading.Event) -> None:
        while not stop.is_set():
            with self.wake:
                if not self.waiting and not self.num_running and self.in_flight is None:
                    self.wake.wait(timeout=0.1)
                    continue
            self.step_or_fail()

    def step_or_fail(self) -> None:
        """A step; if it raises, the running requests fail with its error and the next ones are served."""
        try:
            self.step()
        except Exception as e:  # noqa: BLE001 - fail the running requests, keep serving the next ones
            self._fail_running(e)

    def _fail_running(self, error: Exception) -> None:
        self.in_flight, self.joined = None, []
        for i, r in enumerate(self.rows):
            if r is not None:
                self.rows[i] = None
                r.request.on_done(error)

    def drain(self) -> None:
        """Step until every submitted request has finished (tests, batch use)."""
        while self.waiting or self.num_running or self.in_flight is not None:
            self.step()

    def run_all(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> tuple[list[Completion], int, SpecStats]:
        """Every prompt through the batch, as many at once as there are rows, each next one joining where a
        row finishes (not waiting for the slowest row, as a static batch would), until all are done: the
        completions in prompt order, the target steps taken and the drafts' counters."""
        stats, steps, done = SpecStats(), [0], {}

        def count(k: int, accepted: list[int]) -> None:
            steps[0] += 1
            if k:
                stats.record(k, accepted)

        earlier, self.on_step = self.on_step, count
        try:
            for i, prompt in enumerate(prompts):
                self.submit(Request(list(prompt), params, on_done=lambda result, i=i: done.__setitem__(i, result)))
            self.drain()
        finally:
            self.on_step = earlier
        if failed := next((r for r in done.values() if isinstance(r, BaseException)), None):
            raise failed
        return [done[i] for i in range(len(prompts))], steps[0], stats

    @torch.inference_mode()
    def step(self) -> None:
        """Launch a step over the running rows, then hand out the tokens of the step launched before it,
        which the device has finished or is finishing meanwhile (a step whose rows want logprobs is
        handed out at once: the next launch rewrites its logits)."""
        self._retire_cancelled()
        if self.in_flight is not None and self._reads_history(self.max_k):  # a plain step's tokens, before a lookup
            self._hand_out(*self.in_flight)
            self.in_flight = None
        self._admit()
        busy = [i for i, r in enumerate(self.rows) if r is not None]
        launched = self._launch(busy) if busy else None
        self._emit_first()
        earlier, self.in_flight = self.in_flight, None
        if earlier is not None:
            self._hand_out(*earlier)
        if launched is not None:
            if (
                not self.engine.overlap
                or self._reads_history(launched[0].k)
                or any(r is not None and r.request.logprobs is not None for r in launched[1])
            ):
                self._hand_out(*launched)
            else:
                self.in_flight = launched

    def _launch(self, busy: list[int]) -> tuple[Launched, list[Running | None]]:
        n = bucket(busy[-1] + 1, self.engine.max_batch_size)
        running = self.rows[:n]
        k = self._choose_k(n, [r.acceptance.alpha for r in running if r is not None])
        active = self._active(tuple(r is not None for r in running))
        state = self.state.rows(n)  # views: they advance in place
        histories = [r.request.prompt + r.stop.tokens if r is not None else [0] for r in running] if self._reads_history(k) else []
        return self.engine.launch(state, active, k, self._row_sampling(running), self._random(running), self.proposer, histories), running

    def _reads_history(self, k: int) -> bool:
        return k > 0 and self.proposer.reads_history

    def _active(self, rows: tuple[bool, ...]) -> torch.Tensor:
        """The rows' mask on the device, made once per pattern (a fresh one would wait for the step in flight)."""
        if self._mask is None or self._mask[0] != rows:
            self._mask = (rows, to_device(rows, self.engine.device))
        return self._mask[1]

    def _hand_out(self, launched: Launched, running: list[Running | None]) -> None:
        """Deliver a step's kept tokens to the requests it ran for that are still going (a request that
        stopped or was cancelled since the launch gets nothing), then retire the ones it finished."""
        live = [r if r is not None and r.stop.finish_reason is None and not r.request.cancelled.is_set() else None for r in running]
        active_rows = [r is not None for r in live]
        stops = [r.stop if r is not None else None for r in live]
        deliver = lambda i, tokens: live[i].request.on_tokens(tokens)
        logprobs = [r.request.logprobs if r is not None else None for r in live]
        accepted = self.engine.emit(launched, active_rows, stops, logprobs, SpecStats(), deliver)
        k = launched.k
        if k > 0:
            self.plain_steps = 0
            for r, a in zip(live, accepted):
                if r is not None:
                    r.request.stats.record(k, [a])
                    r.acceptance.record(k, a)
        else:
            self.plain_steps += 1
        self.on_step(k, [a for r, a in zip(live, accepted) if r is not None] if k > 0 else [])
        for i, r in enumerate(live):
            if r is not None and r.stop.finish_reason is not None and self.rows[i] is r:
                self._finish(i)

    def _choose_k(self, n: int, alphas: list[float]) -> int:
        if self.max_k == 0 or not self.adaptive or self.costs is None:
            return self.max_k
        if (n, 0) not in self.costs.step_ms:
            self._time_steps(n)
        k = self.costs.best_k(n, alphas, self.max_k)
        if k == 0 and self.plain_steps + 1 >= PROBE_EVERY:
            return 1  # a probe: one draft token, to refresh the acceptance averages
        return k

    def _random(self, running: list[Running | None]) -> Random:
        own = {i: r.generator for i, r in enumerate(running) if r is not None and r.generator is not None}
        return RowGenerators.of(self.generator, own)

    def _row_sampling(self, running: list[Running | None]) -> RowSampling:
        params = tuple(r.request.params if r is not None else IDLE for r in running)
        if self._sampling is None or self._sampling[0] != params:
            self._sampling = (params, RowSampling.of(list(params), self.engine.device))
        rows = self._sampling[1]
        # views of the batch's penalties (they count each step's output in place), where a row has any
        rows.penalties = self.penalties.rows(len(running)) if any(p.penalised for p in params) else None
        return rows

    def _admit(self) -> None:
        """Prefill waiting requests into free rows (lowest first), all of them in one forward, until the
        batch is full. A batch that fails is retried a request at a time: only a bad request fails."""
        with self.wake:
            free = [i for i, r in enumerate(self.rows) if r is None]
            joining: list[Request] = []
            while self.waiting and len(joining) < len(free):
                request = self.waiting.popleft()
                if not request.cancelled.is_set():
                    joining.append(request)
        if not joining:
            return
        try:
            prefilled = [self._prefill(joining, free[: len(joining)])]
        except Exception:  # noqa: BLE001 - find the request at fault
            prefilled = []
            for request, row in zip(joining, free):
                try:
                    prefilled.append(self._prefill([request], [row]))
                except Exception as e:  # noqa: BLE001 - the request fails, the batch goes on
                    request.on_done(e)
        for p in prefilled:
            if p.penalties is not None and self.penalties is None:
                self.penalties = Penalties.none(len(self.rows), self.engine.target.args.vocab_size, self.engine.device)
            for i, (request, row, stop) in enumerate(zip(p.requests, p.rows, p.stops)):
                request.logprobs = Logprobs.of(request.params)
                self.state.set_row(row, p.state, source=i)
                if self.penalties is not None:  # a row without penalties is cleared of its last request's
                    self.penalties.set_row(row, p.penalties if request.params.penalised else None, source=i)
                self.rows[row] = Running(request, stop, Acceptance.prior(self.prior_alpha), p.generators.get(i))
        self.joined += prefilled
        if not self.engine.overlap or self._reads_history(self.max_k):
            self._emit_first()  # lookup first drafts from the text so far, the first token included

    def _emit_first(self) -> None:
        """Hand the requests that joined their first tokens. Reading them waits for their prefill, so with
        overlap this comes after the next step is launched (their rows in it): the device goes on to that
        step while the host reads, instead of idling through its launch. A request that its first token
        ends is finished here; what the step computes for its row is not handed out."""
        joined, self.joined = self.joined, []
        for p in joined:
            self.engine.emit_first(
                p.state,
                p.last,
                p.stops,
                [r.logprobs for r in p.requests],
                lambda i, tokens, requests=p.requests: requests[i].on_tokens(tokens),
            )
            for row, stop in zip(p.rows, p.stops):
                if stop.finish_reason is not None:  # the row is still its own: only a launch came since _admit
                    self._finish(row)

    def _prefill(self, requests: list[Request], rows: list[int]) -> "Prefilled":
        """The requests prefilled into `rows`, with their stop checkers, their own generators (by index),
        the state with the target's last logits, and their penalties (the first token counted)."""
        stops = [StopChecker(r.params, self.engine.eos_token_ids, self.engine.detokenize) for r in requests]
        sampling = RowSampling.of([r.params for r in requests], self.engine.device)
        sampling.penalties = Penalties.of(
            [r.params for r in requests], [r.prompt for r in requests], self.engine.target.args.vocab_size, self.engine.device
        )
        own = {
            i: torch.Generator(self.engine.device).manual_seed(r.params.seed) for i, r in enumerate(requests) if r.params.seed is not None
        }
        cache_rows = to_device(rows, self.engine.device)
        state, last = self.engine.prefill(
            [r.prompt for r in requests], sampling, RowGenerators.of(self.generator, own), cache_rows=cache_rows
        )
        if sampling.penalties is not None:
            sampling.penalties.record_first(state.pending)
        return Prefilled(requests, rows, stops, own, state, last, sampling.penalties)

    def _retire_cancelled(self) -> None:
        for i, r in enumerate(self.rows):
            if r is not None and r.request.cancelled.is_set():
                self.rows[i] = None  # the client went away: free the row, tell no one

    def _finish(self, row: int) -> None:
        r = self.rows[row]
        self.rows[row] = None
        if self.num_running == 0:
            self.plain_steps = 0  # a request that comes alone next sees the K choices any lone request does
        r.request.on_done(Completion(r.request.prompt, r.stop.tokens, r.stop.finish_reason or "length", r.stop.text, r.request.logprobs))
