"""`draftsmith bench decode`: engine-level decoding speed, side by side in one run.

Every row runs `repeats` times after a warm-up run (which captures CUDA graphs and compiles), and
reports the median tokens/s with the spread (slowest and fastest run) and the target steps taken.
At batch 1, the held-out demo prompts one after another, greedy, exactly `new_tokens` tokens each
(EOS ignored; with stop_at_eos each answer ends at EOS, as served, and tokens/s counts the tokens
generated): optionally transformers `generate` and assisted generation, draftsmith plain decoding
(eager and CUDA graphs only when asked; CUDA graphs and compiled blocks always), and speculative
decoding with each draft (a draft model or an EAGLE-3 head; with lookup, each draft with prompt lookup first
(serve.proposers.LookupFirst) and prompt lookup alone too; with device_lookup, each draft with lookup first
searched on the device) at each K. Then at batch `batch`
(continuous batching, CUDA graphs and compiled blocks as `draftsmith serve` runs): 4 x batch requests,
the prompts cycled in order (request i gets prompt i mod len(prompts)), plain and speculative with
adaptive K <= max K for each draft.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Sequence

import torch

from draftsmith.serve.device import DTYPES
from draftsmith.serve.engine import Engine, eos_ids_of, load_draft
from draftsmith.serve.proposers import LookupFirst, PromptLookup, Proposer
from draftsmith.serve.protocol import chat_token_ids
from draftsmith.serve.sampling import SamplingParams
from draftsmith.serve.scheduler import Scheduler
from draftsmith.serve.stats import SpecStats
from draftsmith.serve.weights import load_model


@dataclass
class BenchRow:
    method: str
    tokens: int  # per run
    target_steps: int  # per run
    runs_tokens_per_s: list[float] = field(default_factory=list)
    tau: float | None = None
    acceptance_rate: float | None = None
    matches_plain: bool | None = None
    differing: int | None = None  # sequences whose tokens differ from plain decoding's
    first_difference: int | None = None  # the earliest token index where one does

    def compare(self, outputs: list[list[int]], plain: list[list[int]]) -> None:
        """Set matches_plain, and where the outputs part from plain decoding's: greedy decoding in bf16 can
        tell a bug (early, many sequences) from a near tie that batch shapes round differently (late, few)."""
        firsts = [i for i in map(first_difference, outputs, plain) if i is not None]
        self.matches_plain, self.differing, self.first_difference = not firsts, len(firsts), min(firsts, default=None)

    @property
    def tokens_per_s(self) -> float:
        return statistics.median(self.runs_tokens_per_s)

    @property
    def spread(self) -> tuple[float, float]:
        return min(self.runs_tokens_per_s), max(self.runs_tokens_per_s)

    @property
    def ms_per_target_step(self) -> float:
        return 1000 * self.tokens / self.tokens_per_s / self.target_steps

    def as_dict(self) -> dict:
        return {
            **asdict(self),
            "tokens_per_s": self.tokens_per_s,
            "spread": list(self.spread),
            "ms_per_target_step": self.ms_per_target_step,
        }


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where two token lists differ (the shorter one's length if one extends the other)."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def chat_prompts(target_dir: Path, chats: Sequence[list[dict]]) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    return [chat_token_ids(tokenizer, chat) for chat in chats]


def timed(
    method: str, run: Callable[[], tuple[list[list[int]], int, SpecStats]], repeats: int, device: str, speculative: bool
) -> tuple[BenchRow, list[list[int]]]:
    """A warm-up run, then `repeats` timed runs of run() -> (outputs, target steps, spec stats)."""
    outputs, steps, stats = run()
    row = BenchRow(
        method,
        sum(len(o) for o in outputs),
        steps,
        tau=stats.tau if speculative else None,
        acceptance_rate=stats.acceptance_rate if speculative else None,
    )
    for _ in range(repeats):
        _sync(device)
        started = time.perf_counter()
        run()
        _sync(device)
        row.runs_tokens_per_s.append(row.tokens / (time.perf_counter() - started))
    return row, outputs


def bench_transformers(
    target_dir: Path,
    prompts: list[list[int]],
    new_tokens: int,
    device: str,
    dtype: str,
    repeats: int,
    assistant_dir: Path | None = None,
    stop_at_eos: bool = False,
) -> BenchRow:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=DTYPES[dtype]).to(device).eval()
    kwargs = {}
    if assistant_dir is not None:
        kwargs["assistant_model"] = AutoModelForCausalLM.from_pretrained(assistant_dir, dtype=DTYPES[dtype]).to(device).eval()
    settings = dict(max_new_tokens=new_tokens, min_new_tokens=0 if stop_at_eos else new_tokens, do_sample=False, **kwargs)

    def run():
        outputs = [model.generate(torch.tensor([p], device=device), **settings)[0, len(p) :].tolist() for p in prompts]
        return outputs, sum(len(o) for o in outputs), SpecStats()

    name = "transformers assisted" if assistant_dir else "transformers generate"
    return timed(name, run, repeats, device, False)[0]


def bench_engine(
    engine: Engine,
    method: str,
    prompts: list[list[int]],
    params: SamplingParams,
    k: int,
    repeats: int,
    device: str,
    proposer: Proposer | None = None,
) -> tuple[BenchRow, list[list[int]]]:
    """Batch 1, prompt after prompt; proposer: what drafts (default: the engine's draft)."""

    def run():
        runs = [engine.generate([p], params, num_speculative_tokens=k, proposer=proposer) for p in prompts]
        stats = SpecStats()
        for g in runs:
            stats.merge(g.stats)
        return [g.completions[0].tokens for g in runs], sum(g.target_steps for g in runs), stats

    return timed(method, run, repeats, device, k > 0)


def bench_batch(
    engine: Engine,
    method: str,
    prompts: list[list[int]],
    params: SamplingParams,
    k: int,
    adaptive: bool,
    requests: int,
    repeats: int,
    device: str,
    proposer: Proposer | None = None,
) -> tuple[BenchRow, list[list[int]]]:
    """`requests` requests (the prompts, cycled) through the continuous-batching scheduler."""
    scheduler = Scheduler(engine, k, adaptive=adaptive, proposer=proposer)
    # step costs for adaptive K at every batch bucket (on a GPU: the steps' CUDA graphs, compiled): the batch
    # shrinks as the last requests finish, and a bucket first met inside a timed run compiles there (likely why
    # a W4A16 draft's third run on the H200 took 28 s where the others took ~2 s); greedy: no sampled forwards
    scheduler.warm_up(full=False)

    def run():
        completions, steps, stats = scheduler.run_all([prompts[i % len(prompts)] for i in range(requests)], params)
        return [c.tokens for c in completions], steps, stats

    return timed(method, run, repeats, device, k > 0)


def draft_names(drafts: Sequence[Path]) -> list[str]:
    """A short name per draft: its kind, numbered when there are several of one kind."""
    from draftsmith.serve.eagle import is_eagle_dir

    kinds = ["eagle3" if is_eagle_dir(d) else "draft" for d in drafts]
    return [f"{kind}{sum(k == kind for k in kinds[:i]) + 1}" if kinds.count(kind) > 1 else kind for i, kind in enumerate(kinds)]


def run_bench(
    target_dir: Path,
    drafts: Sequence[Path],
    prompts: list[list[int]],
    *,
    new_tokens: int = 256,
    ks: tuple[int, ...] = (2, 4, 6),
    device: str = "cuda",
    dtype: str = "bfloat16",
    repeats: int = 3,
    with_transformers: bool = False,
    with_assisted: bool = False,
    with_eager: bool = False,
    batch: int = 16,
    stop_at_eos: bool = False,
    lookup: bool = False,
    device_lookup: bool = False,
    on_row: Callable[[list[BenchRow]], None] | None = None,
) -> list[BenchRow]:
    """The rows of `bench decode` (see the module's docstring); lookup: each draft with prompt lookup first, and
    prompt lookup alone, as more drafts; device_lookup: each draft with lookup first on the device. on_row hears
    the rows so far after each new one (what a run cut short keeps)."""
    max_seq_len = max(len(p) for p in prompts) + new_tokens + max(ks) + 8
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=not stop_at_eos)
    rows: list[BenchRow] = []

    def add(row: BenchRow) -> None:
        rows.append(row)
        if on_row is not None:
            on_row(rows)

    if with_transformers:
        add(bench_transformers(target_dir, prompts, new_tokens, device, dtype, repeats, stop_at_eos=stop_at_eos))
    standalone = [d for d, name in zip(drafts, draft_names(drafts)) if name.startswith("draft")]
    if with_assisted and standalone:
        add(
            bench_transformers(
                target_dir, prompts, new_tokens, device, dtype, repeats, assistant_dir=standalone[0], stop_at_eos=stop_at_eos
            )
        )
    target = load_model(target_dir, DTYPES[dtype], device)
    drafters = drafters_of(drafts, target.args.vocab_size, dtype, device, lookup, device_lookup)
    eos = eos_ids_of(target_dir)
    graphs = device.startswith("cuda")
    # engines share the target and each holds its own KV caches and graphs: one alive at a time
    if graphs and with_eager:  # what CUDA graphs alone save, then what compiling the blocks adds
        for method, graph in (("plain, eager", False), ("plain, CUDA graphs", True)):
            engine = Engine(target, max_seq_len=max_seq_len, cuda_graphs=graph, compile_blocks=False, eos_token_ids=eos)
            add(bench_engine(engine, method, prompts, params, 0, repeats, device)[0])
    mode = "graphs+compile" if graphs else "eager"
    engine = Engine(target, max_seq_len=max_seq_len, cuda_graphs=graphs, eos_token_ids=eos)
    row, plain = bench_engine(engine, f"plain, {mode}", prompts, params, 0, repeats, device)
    add(row)
    for name, (draft, proposer_of) in drafters.items():
        engine = Engine(target, draft, max_seq_len=max_seq_len, cuda_graphs=graphs, eos_token_ids=eos)
        for k in ks:
            row, tokens = bench_engine(engine, f"{name} K={k}, {mode}", prompts, params, k, repeats, device, proposer_of(engine))
            row.compare(tokens, plain)
            add(row)
    if batch > 1:
        requests = 4 * batch
        # as draftsmith serve runs: CUDA graphs and compiled blocks
        engine_of = lambda draft=None: Engine(
            target, draft, max_batch_size=batch, max_seq_len=max_seq_len, cuda_graphs=graphs, eos_token_ids=eos
        )
        # every batch row against batch 1's plain decoding, plain batching included: where plain batching itself
        # parts from it, the target's own rounding at another batch shape does (bf16), not speculation
        alone = [plain[i % len(prompts)] for i in range(requests)]
        row, tokens = bench_batch(engine_of(), f"plain, batch {batch}", prompts, params, 0, False, requests, repeats, device)
        row.compare(tokens, alone)
        add(row)
        for name, (draft, proposer_of) in drafters.items():
            method = f"{name} adaptive K<={max(ks)}, batch {batch}"
            engine = engine_of(draft)
            row, tokens = bench_batch(engine, method, prompts, params, max(ks), True, requests, repeats, device, proposer_of(engine))
            row.compare(tokens, alone)
            add(row)
    return rows


def drafters_of(
    drafts: Sequence[Path], vocab_size: int, dtype: str, device: str, lookup: bool, device_lookup: bool = False
) -> dict[str, tuple]:
    """name -> (the engine's draft, a function of the engine giving the proposer when it is not the draft): with
    lookup, each draft with prompt lookup first (it drafts where a row's text repeats itself), then prompt lookup
    alone, which has no model; with device_lookup, each draft with lookup first searched on the device."""
    engines_draft = lambda engine: None
    drafters: dict[str, tuple[object, Callable[[Engine], Proposer | None]]] = {}
    for name, d in zip(draft_names(drafts), drafts):
        drafters[name] = (load_draft(d, DTYPES[dtype], device), engines_draft)
        if lookup:
            drafters[f"{name} + lookup"] = (drafters[name][0], lambda engine: LookupFirst(engine.draft_proposer, vocab_size))
        if device_lookup:
            first = lambda engine: LookupFirst(engine.draft_proposer, vocab_size, on_device=True)
            drafters[f"{name} + device lookup"] = (drafters[name][0], first)
    if lookup:
        drafters["prompt lookup"] = (None, lambda engine: PromptLookup(vocab_size))
    return drafters


def environment(device: str) -> dict:
    info = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": device,
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    info["cpu"] = cpu_model()  # the host too: steps that wait on it (lookup first's) take longer on a slower one
    return info


def cpu_model() -> str:
    """The host's CPU, as /proc/cpuinfo names it (else what platform knows), and how many cores this process has."""
    try:
        name = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        name = platform.processor() or platform.machine()
    return f"{name}, {len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()} cores"


ROUNDING = (
    "=plain: in {dtype} a forward over several tokens (a verification, a batch) rounds otherwise than one over a "
    "single token, so a near tie can flip a greedy token; --dtype float32 compares exactly"
)


def results_table(rows: list[BenchRow], title: str, dtype: str = "float32"):
    """The rows as a rich table, each against plain decoding at its batch size (and transformers' generate); where
    a row parts from plain decoding in a 16-bit dtype, a caption says why that need not be a fault."""
    from rich.table import Table

    hf = next((r for r in rows if r.method == "transformers generate"), None)
    plain_of = lambda r: [p for p in rows if p.method.startswith("plain") and ("batch" in p.method) == ("batch" in r.method)][-1]
    parted = dtype != "float32" and any(r.matches_plain is False for r in rows)
    table = Table(title=title, caption=ROUNDING.format(dtype=dtype) if parted else None)
    # kept: accepted / drafted at the row's K (vLLM's acceptance rate, which falls with K); alpha is its value at K = 1
    for column in ("method", "tok/s", "min-max", "ms/step", "steps", "tau", "kept", "x HF", "x plain", "=plain"):
        table.add_column(column, justify="right" if column != "method" else "left")
    for r in rows:
        low, high = r.spread
        table.add_row(
            r.method,
            f"{r.tokens_per_s:.1f}",
            f"{low:.0f}-{high:.0f}",
            f"{r.ms_per_target_step:.3f}",
            str(r.target_steps),
            f"{r.tau:.2f}" if r.tau else "",
            f"{r.acceptance_rate:.2f}" if r.acceptance_rate is not None else "",
            f"{r.tokens_per_s / hf.tokens_per_s:.1f}x" if hf else "",
            f"{r.tokens_per_s / plain_of(r).tokens_per_s:.2f}x",
            {True: "yes", False: f"no: {r.differing} from token {r.first_difference}", None: ""}[r.matches_plain],
        )
    return table


def write_results(rows: list[BenchRow], path: Path, command: str, device: str, extra: dict | None = None) -> None:
    payload = {**environment(device), "command": command, **(extra or {}), "rows": [r.as_dict() for r in rows]}
    path.write_text(json.dumps(payload, indent=2))
