"""`draftsmith bench serve`: a load generator against a running OpenAI-compatible server (ours or vLLM).

At each concurrency level, that many clients (asyncio + httpx) stream chat completions back to back,
cycling through the prompts, for `duration` seconds; a request still running at the end is waited
for and counted. Reported per level: requests, errors, output tokens/s over the level's wall time,
and time to first token and time per output token (p50, p99). Output tokens come from the final
usage chunk (`stream_options.include_usage`), which both servers send.

`compare_engine` serves a bundle from this process, its engine in a process of its own as `draftsmith serve`
runs it, and loads it at each level from a process of its own (as real clients are: their Python work does
not contend for the server's interpreter lock), then drives the same bundle's engine loaded in this process
directly (no HTTP, no tokenization per request, same prompts, max_tokens and greedy settings) with the same
number of requests always in flight: each level gains the engine's tokens/s and the server's share of it, and
where the time went: the share of each level's wall time that the engine process's stepping thread and the server's HTTP
thread (the event loop: parsing, detokenizing, SSE) spent on a CPU, and the engine's thread alone. With
repeats, the levels run that many rounds after one warm-up and `median_rows` gives each level's medians and
the ratio's spread.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np


@dataclass
class Sample:
    ttft: float | None = None
    tpot: float | None = None
    tokens: int = 0
    error: str | None = None


async def stream_one(client, url: str, model: str, messages: list[dict], max_tokens: int, headers: dict) -> Sample:
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    sample, first_at, done = Sample(), None, False
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers) as response:
            if response.status_code != 200:
                return Sample(error=f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
            async for line in response.aiter_lines():
                done = done or line == "data: [DONE]"
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: ") :])
                if "error" in chunk:
                    return Sample(error=str(chunk["error"]))
                if chunk.get("usage"):
                    sample.tokens = chunk["usage"]["completion_tokens"]
                if first_at is None and any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                    first_at = time.perf_counter()
                    sample.ttft = first_at - started
    except Exception as e:  # noqa: BLE001 - a failed request is a counted error, not a crashed benchmark
        return Sample(error=f"{type(e).__name__}: {e}")
    if not done:
        return Sample(error="the stream ended without [DONE]")
    if first_at is not None and sample.tokens > 1:
        sample.tpot = (time.perf_counter() - first_at) / (sample.tokens - 1)
    return sample


async def run_level(
    url: str, model: str, prompts: Sequence[list[dict]], concurrency: int, max_tokens: int, duration: float, api_key: str | None
) -> dict:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    samples: list[Sample] = []
    deadline = time.perf_counter() + duration
    started = time.perf_counter()
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:

        async def worker(w: int) -> None:
            i = w
            while time.perf_counter() < deadline:
                samples.append(await stream_one(client, url, model, prompts[i % len(prompts)], max_tokens, headers))
                i += concurrency

        await asyncio.gather(*(worker(w) for w in range(concurrency)))
    wall = time.perf_counter() - started
    ok = [s for s in samples if s.error is None]
    pct = lambda values, q: round(float(np.percentile(values, q)) * 1000, 2) if values else None
    ttft, tpot = [s.ttft for s in ok if s.ttft is not None], [s.tpot for s in ok if s.tpot is not None]
    return {
        "concurrency": concurrency,
        "requests": len(samples),
        "errors": len(samples) - len(ok),
        "first_error": next((s.error for s in samples if s.error), None),
        "output_tokens": sum(s.tokens for s in ok),
        "seconds": round(wall, 2),
        "tokens_per_s": round(sum(s.tokens for s in ok) / wall, 1),
        "ttft_p50_ms": pct(ttft, 50),
        "ttft_p99_ms": pct(ttft, 99),
        "tpot_p50_ms": pct(tpot, 50),
        "tpot_p99_ms": pct(tpot, 99),
    }


def model_of(url: str, api_key: str | None) -> str:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.get(f"{url}/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]


def bench_serve(
    url: str,
    prompts: Sequence[list[dict]],
    concurrencies: Sequence[int] = (1, 4, 16, 64),
    max_tokens: int = 256,
    duration: float = 30.0,
    api_key: str | None = None,
    model: str | None = None,
) -> list[dict]:
    """One row per concurrency level (see the module docstring)."""
    if not prompts:
        raise ValueError("no prompts to send")
    url = url.rstrip("/")
    model = model or model_of(url, api_key)
    return [asyncio.run(run_level(url, model, prompts, c, max_tokens, duration, api_key)) for c in concurrencies]


def engine_level(scheduler, ids: Sequence[list[int]], concurrency: int, max_tokens: int, duration: float) -> dict:
    """A running scheduler (its thread steps it), fed directly (no HTTP, no tokenization per request) with
    `concurrency` requests always in flight, cycling through the prompts' token ids for `duration` seconds;
    requests still running at the end are waited for."""
    import threading

    from draftsmith.serve.sampling import SamplingParams
    from draftsmith.serve.scheduler import Request

    params = SamplingParams(temperature=0.0, max_new_tokens=max_tokens)
    done: list = []
    lock, finished = threading.Lock(), threading.Event()
    started = time.perf_counter()
    deadline = started + duration
    submitted = 0

    def submit() -> None:
        nonlocal submitted
        scheduler.submit(Request(ids[submitted % len(ids)], params, on_done=on_done))
        submitted += 1

    def on_done(result) -> None:  # on the engine's thread
        with lock:
            done.append(result)
            if time.perf_counter() < deadline and not isinstance(result, BaseException):
                submit()
            elif len(done) == submitted:
                finished.set()

    with lock:
        for _ in range(concurrency):
            submit()
    finished.wait()
    wall = time.perf_counter() - started
    if failed := next((r for r in done if isinstance(r, BaseException)), None):
        raise RuntimeError(f"the engine failed a request: {failed}") from failed
    tokens = sum(len(r.tokens) for r in done)
    return {"engine_requests": len(done), "engine_tokens_per_s": round(tokens / wall, 1)}


def cpu_seconds(pid: int | None = None) -> dict[str, float]:
    """CPU seconds used by each of this process's Python threads, by thread name, and by the main thread of
    process `pid` (the thread that steps an engine process) under "engine_process" (Linux; empty elsewhere)."""
    import os
    import threading

    tick, used = os.sysconf("SC_CLK_TCK"), {}
    stats = {thread.name: f"/proc/self/task/{thread.native_id}/stat" for thread in threading.enumerate()}
    if pid is not None:
        stats["engine_process"] = f"/proc/{pid}/task/{pid}/stat"
    for name, path in stats.items():
        try:  # utime and stime are the 14th and 15th fields
            fields = Path(path).read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        used[name] = (int(fields[11]) + int(fields[12])) / tick
    return used


def busy_shares(before: dict[str, float], wall: float, names: Sequence[str], pid: int | None = None) -> dict[str, float | None]:
    """The share of `wall` seconds that each named thread spent on a CPU since `before` (cpu_seconds)."""
    after = cpu_seconds(pid)
    return {name: round((after[name] - before[name]) / wall, 3) if name in after and name in before else None for name in names}


def compare_engine(
    bundle,
    prompts: Sequence[list[dict]],
    concurrencies: Sequence[int],
    max_tokens: int,
    duration: float,
    device: str = "auto",
    dtype: str = "bfloat16",
    max_model_len: int = 2048,
    max_batch_size: int = 16,
    repeats: int = 1,
) -> list[dict]:
    """Server rows (as bench_serve) for `draftsmith serve <bundle>` run from this process (its engine in a
    process of its own, as `draftsmith serve` runs it), each with the tokens/s of the same engine run in this
    process alone at the same concurrency, measured right after it, and the ratio server / engine; `repeats`
    rounds over the levels after one warm-up (the row's `repeat` says which)."""
    import multiprocessing
    import socket
    import threading
    from concurrent.futures import ProcessPoolExecutor

    import httpx
    import uvicorn

    from draftsmith.pipeline.serving import load_scheduler, load_server
    from draftsmith.serve.protocol import ChatRequest
    from draftsmith.serve.server import create_app

    server = load_server(bundle, device, dtype, max_model_len, max_batch_size)
    ids = [server.prompt_ids(ChatRequest(messages=m))[0] for m in prompts]  # as the server tokenizes them
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    http = uvicorn.Server(uvicorn.Config(create_app(server), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=http.run, name="http", daemon=True)
    thread.start()
    url, pid = f"http://127.0.0.1:{port}", server.scheduler.pid
    rows, stop_alone = [], threading.Event()
    try:
        while not (http.started and httpx.get(f"{url}/ready", timeout=30).status_code == 200):
            if server.failed is not None:
                raise RuntimeError(f"the server's warm-up failed: {server.failed}") from server.failed
            if not thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.2)
        # the same engine in this process, warmed up after the server's (each times its steps undisturbed)
        alone = load_scheduler(bundle, device, dtype, max_model_len, max_batch_size, None, True)
        alone.warm_up()
        threading.Thread(target=alone.serve_forever, args=(stop_alone,), name="alone", daemon=True).start()
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as clients:
            for repeat in range(1, repeats + 1):
                for concurrency in concurrencies:
                    before, started = cpu_seconds(pid), time.perf_counter()
                    row = clients.submit(bench_serve, url, prompts, [concurrency], max_tokens, duration, None, server.model_name).result()[
                        0
                    ]
                    busy = busy_shares(before, time.perf_counter() - started, ("engine_process", "http"), pid)
                    before, started = cpu_seconds(), time.perf_counter()
                    row.update(engine_level(alone, ids, concurrency, max_tokens, duration), repeat=repeat)
                    busy_alone = busy_shares(before, time.perf_counter() - started, ("alone",))
                    row.update(engine_busy=busy["engine_process"], http_busy=busy["http"], engine_busy_alone=busy_alone["alone"])
                    row["server_over_engine"] = round(row["tokens_per_s"] / row["engine_tokens_per_s"], 3)
                    rows.append(row)
    finally:
        http.should_exit = True
        thread.join()  # the lifespan's end stops the engine's process
        stop_alone.set()
    return rows


def median_rows(rows: Sequence[dict]) -> list[dict]:
    """Per concurrency over the repeats: the median of server and engine tokens/s, of the ratio (with its
    lowest and highest) and of TTFT p50."""
    levels = dict.fromkeys(r["concurrency"] for r in rows)
    summary = []
    for concurrency in levels:
        runs = [r for r in rows if r["concurrency"] == concurrency]

        def median(key: str) -> float | None:
            values = [r[key] for r in runs if r[key] is not None]
            return round(float(np.median(values)), 3) if values else None

        ratios = [r["server_over_engine"] for r in runs]
        summary.append(
            {
                "concurrency": concurrency,
                "runs": len(runs),
                "tokens_per_s": median("tokens_per_s"),
                "engine_tokens_per_s": median("engine_tokens_per_s"),
                "server_over_engine": median("server_over_engine"),
                "ratio_low": min(ratios),
                "ratio_high": max(ratios),
                "ttft_p50_ms": median("ttft_p50_ms"),
                "ttft_p99_ms": median("ttft_p99_ms"),
                "engine_busy": median("engine_busy"),
                "http_busy": median("http_busy"),
                "engine_busy_alone": median("engine_busy_alone"),
            }
        )
    return summary
