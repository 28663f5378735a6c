"""The server's Prometheus metrics: the spec-decode counters under vLLM's names with our prefix (DESIGN.md),
queue gauges, token counters and latency histograms."""

from __future__ import annotations

from draftsmith.serve.stats import SpecStats

PREFIX = "draftsmith:"


class Metrics:
    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        spec = lambda name, doc, *labels: Counter(f"{PREFIX}spec_decode_{name}", doc, labels, registry=self.registry)
        self.drafts = spec("num_drafts", "speculative verification steps")
        self.draft_tokens = spec("num_draft_tokens", "tokens proposed by the draft")
        self.accepted = spec("num_accepted_tokens", "draft tokens the target accepted")
        self.accepted_per_pos = spec("num_accepted_tokens_per_pos", "accepted draft tokens by position", "position")
        self.running = Gauge(f"{PREFIX}num_requests_running", "requests in the running batch", registry=self.registry)
        self.waiting = Gauge(f"{PREFIX}num_requests_waiting", "requests queued for a free row", registry=self.registry)
        tokens = lambda name, doc: Counter(f"{PREFIX}{name}", doc, registry=self.registry)
        self.prompt_tokens = tokens("prompt_tokens", "prompt tokens of finished requests")
        self.generation_tokens = tokens("generation_tokens", "tokens generated for finished requests")
        self.k = Gauge(f"{PREFIX}spec_decode_num_speculative_tokens", "K of the latest step (0: plain)", registry=self.registry)
        hist = lambda name, doc: Histogram(
            f"{PREFIX}{name}", doc, registry=self.registry, buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
        )
        self.ttft = hist("time_to_first_token_seconds", "time to first token")
        self.tpot = hist("time_per_output_token_seconds", "time per output token after the first")
        self.e2e = hist("e2e_request_latency_seconds", "end-to-end request latency")

    def count_step(self, k: int, accepted: list[int]) -> None:
        """The spec counters of one step (on the engine thread)."""
        step = SpecStats()
        step.record(k, accepted)
        self.k.set(k)
        self.drafts.inc(step.num_drafts)
        self.draft_tokens.inc(step.num_draft_tokens)
        self.accepted.inc(step.num_accepted_tokens)
        for position, n in enumerate(step.accepted_per_position):
            self.accepted_per_pos.labels(position=str(position)).inc(n)

    def observe_request(self, prompt_tokens: int, tokens: int, started: float, first_at: float | None, now: float) -> None:
        """The token counts and latencies of a finished request (perf_counter times)."""
        self.e2e.observe(now - started)
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(tokens)
        if first_at is not None and tokens > 1:
            self.tpot.observe((now - first_at) / (tokens - 1))
