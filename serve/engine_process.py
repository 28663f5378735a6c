"""The scheduler and its engine in a process of their own, as `draftsmith serve` runs them.

In one process the HTTP server's work and the engine's share Python's interpreter lock: on one H200 at
concurrency 16 the engine's thread was on a CPU 61-66% of the time against 99.5% alone, the HTTP thread
the rest, and the server kept 0.71 of its engine's tokens/s (benchmarks/RESULTS.md). Here the engine's
process steps on its own; each step's kept tokens, finished requests and step counts go to the server in
one message, and the server's requests reach it through another pipe, read between steps.

`EngineProcess` is what the server holds in place of a Scheduler (serve/server.py takes either): `submit`
checks a request against the engine's limits at once (EngineError) and sends it; `warm_up` waits for the
engine process's warm-up; `serve_forever` has the server's event loop read the engine's messages and hand
each step's tokens to the requests' callbacks, until told to stop. On the way in and out a request makes no
hop between threads when it can help it: at concurrency 1 those hops are what the server loses against its
engine, whose process waits for each next request.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import multiprocessing
import queue
import struct
import threading
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Callable

try:  # how full the requests' pipe is (Linux)
    import fcntl
    import termios
except ImportError:
    fcntl = termios = None

from draftsmith.serve.engine import EngineError, Logprobs
from draftsmith.serve.scheduler import Request, Scheduler

log = logging.getLogger("draftsmith")
STOP = ("stop",)
DIRECT_IDS = 4096  # a request with at most this many prompt ids is pickled and sent on the event loop, when the pipe has room


class EngineProcessError(RuntimeError):
    """The engine's process failed: its load, its warm-up, or it exited."""


def portable(error: BaseException) -> BaseException:
    """An error as it crosses to the server: an EngineError as it is, any other (of whatever class, which may not
    survive the trip) as a RuntimeError that says what it was."""
    return error if type(error) is EngineError else RuntimeError(f"{type(error).__name__}: {error}")


class Cancellation(threading.Event):
    """A request's `cancelled` flag that also tells the engine's process, which frees the request's row."""

    def __init__(self, tell: Callable[[], None]):
        super().__init__()
        self.tell = tell

    def set(self) -> None:
        if not self.is_set():
            super().set()
            self.tell()


class EngineProcess:
    """The server's side of the engine's process: what Server needs of a Scheduler."""

    def __init__(self, build: Callable[[], Scheduler], on_step: Callable[[int, list[int]], None] = lambda k, accepted: None):
        """build: a picklable function that makes the scheduler (and its engine) in the new process. Returns
        once the engine is loaded (its warm-up follows: warm_up), or raises why it could not be."""
        self.on_step = on_step  # (K, accepted drafts per row) after every step, as Scheduler's
        context = multiprocessing.get_context("spawn")  # the engine's process starts CUDA of its own
        requests_in, self._requests_out = context.Pipe(duplex=False)  # (the end that receives, the end that sends)
        self._events_in, events_out = context.Pipe(duplex=False)
        # not a daemon: torch.compile starts worker processes of its own. It exits when the server's end closes
        self.process = context.Process(target=run_engine, args=(build, requests_in, events_out), name="draftsmith-engine")
        self.process.start()
        requests_in.close()
        events_out.close()
        self._sends: queue.SimpleQueue = queue.SimpleQueue()
        self._lock, self._backlog = threading.Lock(), 0  # messages queued for the requests' thread and not yet sent
        self._requests: dict[int, Request] = {}
        self._ids = itertools.count()
        self.num_running = self.num_waiting = 0
        self.failure: BaseException | None = None  # why the engine's process ended, if it did first
        self._ended = threading.Event()
        loaded = self._receive()
        if loaded[0] == "failed":
            raise EngineProcessError(f"the engine could not be loaded: {loaded[1]}") from loaded[1]
        _, self.limits, self.max_k, self.can_draft = loaded
        threading.Thread(target=self._send_all, name="engine-requests", daemon=True).start()

    @property
    def pid(self) -> int:
        return self.process.pid

    # -- the event loop's side --------------------------------------------------------------------
    def submit(self, request: Request) -> None:
        """Queue a request in the engine's process; EngineError (too long, ids outside the vocabulary) at once."""
        self.limits.check([request.prompt], [request.params], self.max_k, self.can_draft)
        rid = next(self._ids)
        request.cancelled = Cancellation(lambda: self._cancel(rid))
        request.logprobs = Logprobs.of(request.params)
        self._requests[rid] = request
        self._send(("submit", rid, request.prompt, request.params), len(request.prompt))

    def _cancel(self, rid: int) -> None:
        if self._requests.pop(rid, None) is not None:  # still going: its row is freed at the engine's next step
            self._send(("cancel", rid))

    def _send(self, message: tuple, ids: int = 0) -> None:
        """To the engine's process, in order: written by the caller when the pipe has room for the whole message
        (a write that cannot wait, a thread's hop saved on every request's way in), else queued for the requests'
        thread, whose write may wait for the engine to read."""
        data = ForkingPickler.dumps(message) if ids <= DIRECT_IDS else None
        with self._lock:
            if data is not None and not self._backlog and len(data) + 8 <= self._room():
                try:
                    self._requests_out.send_bytes(data)
                except (OSError, ValueError):  # the engine's process is gone: serve_forever says so
                    pass
                return
            self._backlog += 1
        self._sends.put(message)

    def _room(self) -> int:
        """Bytes the requests' pipe takes now without waiting (Linux; 0 elsewhere: every message goes by the thread)."""
        if not hasattr(fcntl, "F_GETPIPE_SZ"):
            return 0
        try:
            fd = self._requests_out.fileno()
            unread = struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]
            return fcntl.fcntl(fd, fcntl.F_GETPIPE_SZ) - unread
        except (OSError, ValueError):  # closed
            return 0

    def _send_all(self) -> None:
        """The requests' thread: a large prompt's send may wait for the engine to read it, the event loop never does."""
        while (message := self._sends.get()) is not None:
            try:
                self._requests_out.send(message)
            except (OSError, ValueError):  # the engine's process is gone: serve_forever says so
                return
            with self._lock:
                self._backlog -= 1

    # -- the thread that stands in for the engine's (Server.start) ---------------------------------
    def warm_up(self) -> None:
        """Wait for the engine process's warm-up (step costs, CUDA graphs); its error if it failed."""
        message = self._receive()
        if message[0] == "failed":
            self._stop()
            raise message[1]

    def serve_forever(self, stop: threading.Event, loop: asyncio.AbstractEventLoop) -> None:
        """Have `loop` read the engine's messages as they come, handing each step's tokens to the requests'
        callbacks there, until `stop` is set; then stop the engine's process. EngineProcessError (every request
        told) if that process exits first."""
        fd = self._events_in.fileno()
        self._ended = stop
        loop.call_soon_threadsafe(loop.add_reader, fd, self._read, loop)
        try:
            stop.wait()
        finally:
            try:
                loop.call_soon_threadsafe(loop.remove_reader, fd)
            except RuntimeError:  # the loop is closed
                pass
            self._stop()
        if self.failure is not None:
            raise self.failure

    def _read(self, loop: asyncio.AbstractEventLoop) -> None:
        """The event loop's reader of the engine's messages: each step's tokens to its requests' callbacks (one
        wake-up of the loop, where a thread of its own took two: its own, then the loop's)."""
        while self._events_in.poll():
            message = self._receive()
            if message[0] == "failed":
                loop.remove_reader(self._events_in.fileno())
                self.failure, requests, self._requests = message[1], self._requests, {}
                for request in requests.values():
                    request.on_done(message[1])
                self._ended.set()
                return
            _, events, self.num_running, self.num_waiting = message
            self._dispatch(events)

    def _receive(self) -> tuple:
        try:
            return self._events_in.recv()
        except (EOFError, OSError):
            self.process.join(5)
            return ("failed", EngineProcessError(f"the engine's process exited (code {self.process.exitcode})"))

    def _dispatch(self, events: list[tuple]) -> None:
        for event in events:
            if event[0] == "step":
                self.on_step(event[1], event[2])
                continue
            request = self._requests.get(event[1])
            if request is None:  # cancelled since the engine sent this
                continue
            if event[0] == "done":
                del self._requests[event[1]]
                request.on_done(event[2])
                continue
            _, _, tokens, logprobs = event
            if logprobs is not None:
                request.logprobs.tokens += logprobs.tokens
                request.logprobs.top_tokens += logprobs.top_tokens
            request.on_tokens(tokens)

    def _stop(self) -> None:
        self._send(STOP)
        self._sends.put(None)
        self.process.join(30)
        if self.process.is_alive():
            self.process.terminate()


def run_engine(build: Callable[[], Scheduler], requests: Connection, events: Connection) -> None:
    """The engine's process: load, tell the limits, warm up, tell ready, then step, reading requests between steps."""
    import signal

    from draftsmith.serve.server import console_log

    # the server's process decides when this one ends (a Ctrl-C or a SIGTERM to the whole group lets it drain
    # first); it ends on its own when the server's end of the pipes closes
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    console_log()
    try:
        scheduler = build()
    except BaseException as e:  # noqa: BLE001 - the server says why
        events.send(("failed", portable(e)))
        return
    events.send(("loaded", scheduler.engine.limits, scheduler.max_k, scheduler.proposer is not None))
    try:
        scheduler.warm_up()
    except BaseException as e:  # noqa: BLE001 - out of device memory, say: /health and /ready say so
        log.exception("the warm-up failed")
        events.send(("failed", portable(e)))
        return
    gc.freeze()  # as Server.start does: what loading made lives as long as the process
    events.send(("ready",))
    EngineLoop(scheduler, events).run(requests)


class EngineLoop:
    """The engine process's loop: requests between steps, and each step's events in one message."""

    def __init__(self, scheduler: Scheduler, events: Connection):
        self.scheduler, self.out = scheduler, events
        self.events: list[tuple] = []
        self.requests: dict[int, Request] = {}
        self.logged: dict[int, int] = {}  # log-probability entries sent, by request
        scheduler.on_step = lambda k, accepted: self.events.append(("step", k, accepted))

    def run(self, requests: Connection) -> None:
        s, told = self.scheduler, (0, 0)  # the running and waiting counts the server last heard
        while True:
            idle = not s.waiting and not s.num_running and s.in_flight is None
            while idle or requests.poll():  # idle, it waits for the next request
                try:
                    message = requests.recv()
                except EOFError:  # the server is gone
                    return
                if message == STOP:
                    return
                self.take(message)
                idle = False
            s.step_or_fail()
            counts = (s.num_running, s.num_waiting)
            if self.events or counts != told:  # a step that only freed a cancelled row hands out nothing, yet the server must hear it
                events, self.events, told = self.events, [], counts
                self.out.send(("events", events, *counts))

    def take(self, message: tuple) -> None:
        if message[0] == "cancel":
            self.logged.pop(message[1], None)
            if (request := self.requests.pop(message[1], None)) is not None:
                request.cancelled.set()
            return
        _, rid, prompt, params = message
        request = Request(prompt, params, on_tokens=lambda tokens: self.tokens(rid, tokens), on_done=lambda result: self.done(rid, result))
        self.requests[rid], self.logged[rid] = request, 0
        try:
            self.scheduler.submit(request)
        except EngineError as e:  # the server checked the same limits
            self.done(rid, e)

    def tokens(self, rid: int, tokens: list[int]) -> None:
        if (request := self.requests.get(rid)) is None:
            return
        if (logprobs := request.logprobs) is not None:  # these tokens' entries, which the engine records before it hands them out
            start = self.logged[rid]
            self.logged[rid] = start + len(tokens)
            logprobs = logprobs.window(start, start + len(tokens))
        self.events.append(("tokens", rid, tokens, logprobs))

    def done(self, rid: int, result) -> None:
        self.requests.pop(rid, None)
        self.logged.pop(rid, None)
        self.events.append(("done", rid, portable(result) if isinstance(result, BaseException) else result))
