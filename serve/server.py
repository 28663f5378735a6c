"""`draftsmith serve`: an OpenAI-compatible HTTP server over the engine, speculative with the bundle's K.

Endpoints (serve/routes.py): /v1/completions, /v1/chat/completions (the target's chat template), both with
SSE streaming in OpenAI's chunk format (serve/streaming.py); /v1/models, /health, /ready, /metrics
(serve/metrics.py). Requests are continuously batched by serve.scheduler, which `draftsmith serve` runs in a
process of its own (serve/engine_process.py); K adapts per step (see there). Bad input gets a 4xx with an
OpenAI-style error body (serve/protocol.py) and the server keeps serving; a client that goes away frees its
row. The API key and body size are checked in front of it all (serve/middleware.py).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
from contextlib import asynccontextmanager
from typing import Callable

from fastapi import FastAPI

from draftsmith.serve.engine import Engine
from draftsmith.serve.engine_process import EngineProcess
from draftsmith.serve.metrics import Metrics
from draftsmith.serve.middleware import BodyGuard
from draftsmith.serve.protocol import ChatRequest, CompletionRequest, chat_token_ids
from draftsmith.serve.sampling import SamplingParams
from draftsmith.serve.scheduler import Request as EngineRequest
from draftsmith.serve.scheduler import Scheduler

log = logging.getLogger("draftsmith")
# stop strings a request may send, and their length: matching costs time linear in both (serve/stops.py), and
# OpenAI takes 4 stop strings; these leave room for long structured ones
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 4096


def console_log() -> None:
    """draftsmith's own INFO lines (the server's warm-up) on stderr, not those of the libraries it uses."""
    log = logging.getLogger("draftsmith")
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)


class Server:
    """The engine's scheduler (on a thread of this process, or in a process of its own), the tokenizer, and the
    metrics: what the routes use."""

    def __init__(
        self,
        engine: "Engine | Scheduler | EngineProcess",
        tokenizer,
        model_name: str,
        num_speculative_tokens: int,
        max_model_len: int,
        adaptive_k: bool = True,
        smooth_stream: int = 0,
        max_stop_strings: int = MAX_STOP_STRINGS,
        max_stop_chars: int = MAX_STOP_CHARS,
    ):
        """engine: a Scheduler, or an Engine under a scheduler made with num_speculative_tokens and adaptive_k,
        run on a thread of this process; or an EngineProcess, whose scheduler runs in a process of its own."""
        self.tokenizer, self.model_name, self.max_model_len = tokenizer, model_name, max_model_len
        self.k, self.smooth_stream = num_speculative_tokens, smooth_stream
        self.max_stop_strings, self.max_stop_chars = max_stop_strings, max_stop_chars
        self.metrics = Metrics()
        if isinstance(engine, EngineProcess):
            self.vocab_size = engine.limits.vocab_size
            self.scheduler: Scheduler | EngineProcess = engine
            engine.on_step = self.metrics.count_step
        else:
            self.scheduler = engine if isinstance(engine, Scheduler) else Scheduler(engine, num_speculative_tokens, adaptive=adaptive_k)
            self.scheduler.on_step = self.metrics.count_step
            engine = self.scheduler.engine
            self.vocab_size = engine.target.args.vocab_size
            if engine.detokenize is None:  # stop strings are matched on the text the client gets
                engine.detokenize = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
        self.metrics.running.set_function(lambda: self.scheduler.num_running)
        self.metrics.waiting.set_function(lambda: self.scheduler.num_waiting)
        self.ready = False
        self.failed: Exception | None = None  # the warm-up's error, or the engine's process's: the server cannot serve
        self.failure = ""  # what failed, and why
        self.on_failure: Callable[[], None] | None = None  # told after such a failure (the CLI exits)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """The engine thread: warm-up (step costs, CUDA graphs), then /ready, then the batch loop (or, for an
        EngineProcess, the engine's messages read on the event loop that calls this)."""
        loop = asyncio.get_running_loop() if isinstance(self.scheduler, EngineProcess) else None  # reads its messages

        def run() -> None:
            try:
                self.scheduler.warm_up()
                # what loading and warm-up made lives as long as the server: out of the garbage collector's passes,
                # each of which otherwise walked every object torch and transformers made and held the whole process
                # (an 86 ms pause on a CPU, /health with it)
                gc.freeze()
                self.ready = True
                if loop is None:
                    self.scheduler.serve_forever(self._stop)
                else:
                    self.scheduler.serve_forever(self._stop, loop)
            except Exception as e:  # noqa: BLE001 - e.g. out of device memory: /health and /ready say so
                self.failure = f"{'the engine failed' if self.ready else 'the warm-up failed'}: {e}"
                log.exception(self.failure)
                self.ready, self.failed = False, e
                if self.on_failure is not None:
                    self.on_failure()

        self._thread = threading.Thread(target=run, name="engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def prompt_ids(self, request: CompletionRequest | ChatRequest) -> list[list[int]]:
        """The token ids of each of the request's prompts (a chat is one)."""
        if isinstance(request, ChatRequest):
            return [chat_token_ids(self.tokenizer, [m.as_dict() for m in request.messages])]
        return [list(p) if isinstance(p, list) else self.tokenizer.encode(p) for p in request.prompts()]

    def submit(self, ids: list[int], params: SamplingParams, updates: asyncio.Queue, index: int = 0) -> EngineRequest:
        """Queue a request on the scheduler; its tokens lists and then ("done", its Completion or exception)
        arrive on `updates` as (index, item): the choices of one API request share a queue. EngineError for
        a request the engine cannot take."""
        if isinstance(self.scheduler, EngineProcess):  # its messages are read on this event loop
            put = lambda item: updates.put_nowait((index, item))
        else:
            mailbox = Mailbox.of(asyncio.get_running_loop())
            put = lambda item: mailbox.post(updates, (index, item))
        request = EngineRequest(ids, params, on_tokens=put, on_done=lambda result: put(("done", result)))
        self.scheduler.submit(request)
        return request

    def text_of(self, completion) -> str:
        return completion.text if completion.text is not None else self.tokenizer.decode(completion.tokens, skip_special_tokens=True)


class Mailbox:
    """What the engine thread hands to one event loop's queues, delivered in one wake-up of the loop per batch:
    a step hands tokens to every running row, and a wake-up each (a write to the loop's self-pipe and a
    switch of the interpreter lock) would cost the engine thread more than its step's own work at
    concurrency 16 and a small K."""

    _of: dict[asyncio.AbstractEventLoop, "Mailbox"] = {}

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.items, self.lock = loop, [], threading.Lock()

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> "Mailbox":
        if loop not in cls._of:
            cls._of = {other: box for other, box in cls._of.items() if not other.is_closed()} | {loop: cls(loop)}
        return cls._of[loop]

    def post(self, queue: asyncio.Queue, item) -> None:
        with self.lock:
            self.items.append((queue, item))
            wake = len(self.items) == 1  # a delivery is already due otherwise; it takes this item too
        if wake and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self.lock:
            items, self.items = self.items, []
        for queue, item in items:
            queue.put_nowait(item)


def create_app(server: Server, api_key: str | None = None, max_body_bytes: int = 4 << 20) -> FastAPI:
    from draftsmith.serve.routes import add_error_handlers, add_routes

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.start()  # warm-up runs on the engine thread; /ready tells when it is done
        yield
        server.stop()

    app = FastAPI(title="draftsmith", lifespan=lifespan)
    app.add_middleware(BodyGuard, max_bytes=max_body_bytes, api_key=api_key)
    add_error_handlers(app)
    add_routes(app, server)
    return app
