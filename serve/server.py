"""`draftsmith serve`: an OpenAI-compatible HTTP server over the engine, speculative with the bundle's K.

Endpoints: /v1/completions, /v1/chat/completions (the target's chat template), both with SSE
streaming in OpenAI's chunk format; /v1/models, /health, /ready, /metrics (Prometheus; the spec-decode
counters of DESIGN.md under vLLM's names with our prefix). Requests are continuously batched by
serve.scheduler on one engine thread; K adapts per step (see there). Bad input gets a 4xx with an
OpenAI-style error body and the server keeps serving; a client that goes away frees its row.
"""
from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import AsyncIterator, Callable, ClassVar, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, Field, field_validator

from draftsmith.serve.engine import Completion, Engine, EngineError, Logprobs
from draftsmith.serve.sampling import SamplingError, SamplingParams
from draftsmith.serve.scheduler import Request as EngineRequest, Scheduler
from draftsmith.serve.stats import SpecStats

log = logging.getLogger("draftsmith")
PREFIX = "draftsmith:"
MAX_TOP_LOGPROBS = 20  # as vLLM's default max_logprobs
MAX_N = 64  # choices per request: each is a row of the running batch
DISCONNECT_CHECK_S = 0.25  # how often a waiting non-streaming request looks for its client


class BundleSourceError(ValueError):
    """`draftsmith serve` was given something that is neither a bundle dir nor a models:/ URI."""


def resolve_bundle(source: str, tracking_uri: str | None = None) -> Path:
    """A bundle dir, or the bundle inside a registered model (`models:/<name>@<alias>` or `/<version>`)."""
    if source.startswith("models:/"):
        import mlflow
        from mlflow.exceptions import MlflowException

        if tracking_uri and tracking_uri.startswith("sqlite:///") and not Path(tracking_uri.removeprefix("sqlite:///")).is_file():
            raise BundleSourceError(f"{source}: there is no MLflow store at {tracking_uri} (--tracking-uri names the registry; "
                                    "the pipeline's is sqlite:///<run root>/mlflow.db)")
        if tracking_uri:
            mlflow.set_tracking_uri(tracking_uri)
            mlflow.set_registry_uri(tracking_uri)
        try:
            local = Path(mlflow.artifacts.download_artifacts(artifact_uri=source))
        except (MlflowException, OSError) as e:
            first = (getattr(e, "message", None) or str(e)).strip().splitlines()[0]
            raise BundleSourceError(f"{source} could not be read from the registry at {tracking_uri or 'the default URI'}: "
                                    f"{first} (--tracking-uri names the registry)") from None
        found = [p.parent for p in local.rglob("manifest.json") if p.parent.name == "bundle"]
        if not found:
            raise BundleSourceError(f"{source} holds no draftsmith bundle")
        return found[0]
    path = Path(source)
    if not path.is_dir():
        raise BundleSourceError(f"{source}: no such bundle dir (or give models:/<name>@champion)")
    return path


class StreamOptions(BaseModel):
    include_usage: bool = False


class Sampling(BaseModel):
    """The sampling fields both endpoints take; null means the default, as in OpenAI's API."""
    ECHOES: ClassVar[bool] = False  # `echo` (the prompt before the completion): the completions API only
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)  # None: the rest of the context (OpenAI and vLLM do the same)
    max_completion_tokens: int | None = Field(None, ge=1)  # the newer name of max_tokens
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)  # vLLM's extension: -1 or 0 turn it off
    min_p: float | None = Field(None, ge=0.0, le=1.0)  # vLLM's extension: 0 turns it off
    seed: int | None = None  # the request's own generator: the same seed, the same text (at the same K)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None  # include_usage: a last chunk with the token counts
    n: int | None = Field(None, ge=1)
    best_of: int | None = Field(None, ge=1)
    logprobs: bool | int | None = None
    top_logprobs: int | None = None
    echo: bool | None = None
    tools: list | None = None
    response_format: dict | None = None

    def max_new_tokens(self, room: int) -> int:
        return self.max_completion_tokens or self.max_tokens or room

    def wanted_logprobs(self) -> tuple[bool, int]:
        """(log-probabilities wanted, how many alternatives per token): chat's logprobs / top_logprobs."""
        return bool(self.logprobs), self.top_logprobs or 0

    def params(self, max_new_tokens: int) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        logprobs, top = self.wanted_logprobs()
        return SamplingParams(temperature=1.0 if self.temperature is None else self.temperature,
                              top_p=1.0 if self.top_p is None else self.top_p, top_k=max(self.top_k or 0, 0),
                              min_p=self.min_p or 0.0,
                              seed=self.seed, max_new_tokens=max_new_tokens, stop=tuple(stop), logprobs=logprobs,
                              top_logprobs=top)

    def unsupported(self) -> tuple[str, str] | None:
        """(parameter, why) for a request this server would otherwise answer differently than asked."""
        n = self.n or 1
        if n > MAX_N:
            return "n", f"at most {MAX_N} choices per request"
        if (self.best_of or n) != n:
            return "best_of", "best_of other than n is not supported (choices are not ranked)"
        logprobs, top = self.wanted_logprobs()
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            return "top_logprobs" if self.top_logprobs else "logprobs", f"at most {MAX_TOP_LOGPROBS} alternatives per token"
        if top and not logprobs:
            return "top_logprobs", "top_logprobs needs logprobs: true"
        if self.echo and not self.ECHOES:
            return "echo", "echo is supported by the completions API only"
        if self.echo and logprobs:
            return "echo", "echo with logprobs is not supported (the prompt's log-probabilities are not computed)"
        if self.tools:
            return "tools", "tool calls are not supported"
        if self.response_format and self.response_format.get("type", "text") != "text":
            return "response_format", "only the text response format is supported"
        return None


class CompletionRequest(Sampling):
    ECHOES: ClassVar[bool] = True
    prompt: str | list[int] | list[str] | list[list[int]]

    def wanted_logprobs(self) -> tuple[bool, int]:
        """The completions API's logprobs: the number of alternatives per token (0: the chosen token's only)."""
        if self.logprobs is None or self.logprobs is False:
            return False, 0
        return True, 0 if self.logprobs is True else int(self.logprobs)

    @field_validator("prompt")
    @classmethod
    def some_prompt(cls, prompt):
        """A string or token ids, or a list of several of those (a choice or n for each)."""
        if not all(several(prompt)):
            raise ValueError("the prompt is empty")
        return prompt

    def prompts(self) -> list[str | list[int]]:
        return several(self.prompt)


def several(prompt: str | list) -> list:
    """The prompts of a completions request's `prompt`: one (a string or token ids) or a list of them."""
    return prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else [prompt]


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart]

    def as_dict(self) -> dict:
        """The message as a chat template reads it: content parts joined; developer is a system message."""
        content = self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)


def token_logprobs(tokenizer, tokens: list[int], logprobs: Logprobs, chat: bool) -> dict:
    """The target's log-probabilities of a completion's tokens in OpenAI's shape: chat's `content` list,
    or the completions API's parallel lists."""
    piece = lambda token: tokenizer.decode([token])
    if chat:
        entry = lambda text, value: {"token": text, "logprob": value, "bytes": list(text.encode())}
        content = []
        for i, (token, value) in enumerate(zip(tokens, logprobs.tokens)):
            top = zip(*logprobs.top_tokens[i]) if logprobs.top else ()
            content.append({**entry(piece(token), value), "top_logprobs": [entry(piece(t), v) for t, v in top]})
        return {"content": content}
    texts = [piece(token) for token in tokens]
    offsets = [sum(len(t) for t in texts[:i]) for i in range(len(texts))]
    top = [{piece(t): v for t, v in zip(*logprobs.top_tokens[i])} for i in range(len(texts))] if logprobs.top else None
    return {"tokens": texts, "token_logprobs": logprobs.tokens, "top_logprobs": top, "text_offset": offsets}


def token_usage(prompt_tokens: int, completion_tokens: int) -> dict:
    """OpenAI's `usage` object."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}


def error(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    """OpenAI's error object."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse(status_code=status, content={"error": {"message": message, "type": kind, "param": param, "code": code}})


def settled(text: str, stops: tuple[str, ...]) -> str:
    """What of a streamed text no stop string can still cut away: the text before any stop string, less
    a tail that could begin one. Streaming only this makes stream and non-stream text equal."""
    for stop in stops:
        if (at := text.find(stop)) >= 0:
            text = text[:at]
    tail = max((n for stop in stops for n in range(1, len(stop)) if text.endswith(stop[:n])), default=0)
    return text[:len(text) - tail]


def invalid_unicode(value) -> str | None:
    """The path of the first string in a parsed JSON body that is not valid Unicode (a lone surrogate)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return ""
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if (inner := invalid_unicode(item)) is not None:
            return f"{key}.{inner}".rstrip(".")
    return None


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
        hist = lambda name, doc: Histogram(f"{PREFIX}{name}", doc, registry=self.registry,
                                           buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        self.ttft = hist("time_to_first_token_seconds", "time to first token")
        self.tpot = hist("time_per_output_token_seconds", "time per output token after the first")
        self.e2e = hist("e2e_request_latency_seconds", "end-to-end request latency")


class Server:
    def __init__(self, engine: Engine, tokenizer, model_name: str, num_speculative_tokens: int, max_model_len: int,
                 adaptive_k: bool = True, smooth_stream: int = 0):
        self.tokenizer, self.model_name, self.max_model_len = tokenizer, model_name, max_model_len
        self.k, self.smooth_stream = num_speculative_tokens, smooth_stream
        if engine.detokenize is None:  # stop strings are matched on the text the client gets
            engine.detokenize = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
        self.metrics = Metrics()
        self.scheduler = Scheduler(engine, num_speculative_tokens, adaptive=adaptive_k, on_step=self._count)
        self.metrics.running.set_function(lambda: self.scheduler.num_running)
        self.metrics.waiting.set_function(lambda: self.scheduler.num_waiting)
        self.ready = False
        self.failed: Exception | None = None  # the warm-up's error: the server cannot serve
        self.on_failure: Callable[[], None] | None = None  # told after a failed warm-up (the CLI exits)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """The engine thread: warm-up (step costs, CUDA graphs), then /ready, then the batch loop."""
        def run() -> None:
            try:
                self.scheduler.warm_up()
            except Exception as e:  # noqa: BLE001 - e.g. out of device memory: /health and /ready say so
                log.exception("the warm-up failed")
                self.failed = e
                if self.on_failure is not None:
                    self.on_failure()
                return
            self.ready = True
            self.scheduler.serve_forever(self._stop)

        self._thread = threading.Thread(target=run, name="engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _count(self, k: int, accepted: list[int]) -> None:
        """Spec counters of one step (on the engine thread)."""
        step = SpecStats()
        step.record(k, accepted)
        m = self.metrics
        m.k.set(k)
        m.drafts.inc(step.num_drafts)
        m.draft_tokens.inc(step.num_draft_tokens)
        m.accepted.inc(step.num_accepted_tokens)
        for position, n in enumerate(step.accepted_per_position):
            m.accepted_per_pos.labels(position=str(position)).inc(n)

    def prompt_ids(self, request: CompletionRequest | ChatRequest) -> list[list[int]]:
        """The token ids of each of the request's prompts (a chat is one)."""
        if isinstance(request, ChatRequest):
            ids = self.tokenizer.apply_chat_template([m.as_dict() for m in request.messages], add_generation_prompt=True)
            return [list(ids["input_ids"] if hasattr(ids, "keys") else ids)]
        return [list(p) if isinstance(p, list) else self.tokenizer.encode(p) for p in request.prompts()]

    def submit(self, ids: list[int], params: SamplingParams, updates: asyncio.Queue, index: int = 0) -> EngineRequest:
        """Queue a request on the scheduler; its tokens lists and then ("done", its Completion or exception)
        arrive on `updates` as (index, item): the choices of one API request share a queue. EngineError for
        a request the engine cannot take."""
        loop = asyncio.get_running_loop()
        put = lambda item: loop.call_soon_threadsafe(updates.put_nowait, (index, item))
        request = EngineRequest(ids, params, on_tokens=put, on_done=lambda result: put(("done", result)))
        self.scheduler.submit(request)
        return request

    def text_of(self, completion) -> str:
        return completion.text if completion.text is not None else self.tokenizer.decode(completion.tokens, skip_special_tokens=True)


@dataclass
class Streamed:
    """One choice of a stream: what it has received and what went out."""
    tokens: list[int] = field(default_factory=list)
    text: str = ""  # the tokens' text so far, less a last character still incomplete
    decoded: int = 0  # tokens whose text is in `text`
    window: int = 0  # where the last decode began: the text of tokens[window:decoded] is known
    sent: str = ""  # text sent
    logged: int = 0  # tokens whose log-probabilities were sent
    first_at: float | None = None
    last_burst: float = 0.0
    step_s: float = 0.0  # a moving average of the time between bursts: the pacing budget

    def extend(self, tokens: list[int], decode: Callable[[list[int]], str]) -> None:
        """Take more tokens and their text, decoding only from the last decode's start (decoding the whole
        response per burst cost its length in time; the overlap keeps spacing and merged bytes right)."""
        self.tokens += tokens
        known = decode(self.tokens[self.window:self.decoded])
        both = decode(self.tokens[self.window:])
        if len(both) > len(known) and not both.endswith("\ufffd"):  # no character cut in two
            self.text += both[len(known):]
            self.window, self.decoded = self.decoded, len(self.tokens)


class BodyGuard:
    """ASGI middleware in front of the API: the API key on /v1/*, POST bodies of at most `max_bytes`
    (413 beyond) read as JSON whatever Content-Type the client sent (curl -d sends form-urlencoded).
    Plain ASGI, so that a handler still hears its client disconnect."""

    class TooLarge(Exception):
        pass

    def __init__(self, app, max_bytes: int, api_key: str | None = None):
        self.app, self.max_bytes, self.api_key = app, max_bytes, api_key

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.api_key and scope["path"].startswith("/v1/") and headers.get(b"authorization") != f"Bearer {self.api_key}".encode():
            return await error(401, "missing or wrong API key (Authorization: Bearer <key>)")(scope, receive, send)
        if scope["method"] != "POST":
            return await self.app(scope, receive, send)
        too_large = error(413, f"the request body is larger than {self.max_bytes} bytes (--max-body-bytes)")
        declared = headers.get(b"content-length")
        if declared and declared.isdigit() and int(declared) > self.max_bytes:
            return await too_large(scope, receive, send)
        scope = {**scope, "headers": [(k, v) for k, v in scope["headers"] if k != b"content-type"]
                 + [(b"content-type", b"application/json")]}
        received, started = 0, False

        async def counted():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise BodyGuard.TooLarge
            return message

        async def sending(message):
            nonlocal started
            started = True
            await send(message)

        try:
            await self.app(scope, counted, sending)
        except BodyGuard.TooLarge:
            if not started:
                await too_large(scope, receive, send)


def create_app(server: Server, api_key: str | None = None, max_body_bytes: int = 4 << 20) -> FastAPI:
    from starlette.exceptions import HTTPException

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.start()  # warm-up runs on the engine thread; /ready tells when it is done
        yield
        server.stop()

    app = FastAPI(title="draftsmith", lifespan=lifespan)
    app.add_middleware(BodyGuard, max_bytes=max_body_bytes, api_key=api_key)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":  # its loc is a character offset, not a parameter
            return error(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}")
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return error(400, f"{param or 'body'}: {first.get('msg', 'invalid request')}", param)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:  # 404, 405 and the like
        return error(exc.status_code, str(exc.detail), code={404: "not_found", 405: "method_not_allowed"}.get(exc.status_code))


    @app.get("/health")
    async def health() -> JSONResponse:
        if server.failed is not None:
            return JSONResponse(status_code=500, content={"status": "failed", "error": f"the warm-up failed: {server.failed}"})
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready() -> JSONResponse:
        content = {"ready": server.ready} | ({"error": f"the warm-up failed: {server.failed}"} if server.failed else {})
        return JSONResponse(status_code=200 if server.ready else 503, content=content)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return PlainTextResponse(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    model_card = lambda: {"id": server.model_name, "object": "model", "owned_by": "draftsmith", "created": 0,
                          "max_model_len": server.max_model_len}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != server.model_name:
            return error(404, f"the model {model_id!r} does not exist: this server serves {server.model_name!r}", "model",
                         "model_not_found")
        return model_card()

    async def handle(request: CompletionRequest | ChatRequest, chat: bool, http: Request):
        if request.model is not None and request.model != server.model_name:
            return error(404, f"the model {request.model!r} does not exist: this server serves {server.model_name!r}",
                         "model", "model_not_found")
        if (where := invalid_unicode(request.model_dump())) is not None:
            return error(400, f"{where}: not valid Unicode (a lone surrogate)", where)
        if unsupported := request.unsupported():
            return error(400, f"{unsupported[0]}: {unsupported[1]}", unsupported[0])
        prompts = await asyncio.to_thread(server.prompt_ids, request)  # tokenizing a long prompt must not stall the loop
        asked = "max_completion_tokens" if request.max_completion_tokens else "max_tokens"
        jobs = []  # (prompt ids, params) per choice: n for each prompt, rows of the batch
        for ids in prompts:
            room = server.max_model_len - len(ids)
            new_tokens = request.max_new_tokens(room)
            if room < 1 or new_tokens > room:
                return error(400, f"{len(ids)} prompt tokens + {asked} {new_tokens} exceed the context of "
                                  f"{server.max_model_len} tokens", asked if room >= 1 else ("messages" if chat else "prompt"))
            try:
                params = request.params(new_tokens)
            except SamplingError as e:
                return error(400, str(e))
            # with a seed, a prompt's choice i samples with seed + i
            jobs += [(ids, params if params.seed is None or i == 0 else replace(params, seed=params.seed + i))
                     for i in range(request.n or 1)]
        if len(jobs) > MAX_N:
            return error(400, f"n: at most {MAX_N} choices per request (prompts x n)", "n")
        # echo: each choice's text starts with its prompt (token ids decoded, off the event loop)
        echo = lambda: [p if isinstance(p, str) else server.tokenizer.decode(p) for p in request.prompts() for _ in range(request.n or 1)]
        echoes = await asyncio.to_thread(echo) if request.echo else [""] * len(jobs)
        rid, created = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}", int(time.time())
        kind = "chat.completion" if chat else "text_completion"
        started = time.perf_counter()
        submitted, updates = [], asyncio.Queue()
        try:
            for index, (ids, params) in enumerate(jobs):
                submitted.append(server.submit(ids, params, updates, index))
        except EngineError as e:
            for engine_request in submitted:
                engine_request.cancelled.set()
            return error(400, str(e))
        if request.stream:
            usage = request.stream_options is not None and request.stream_options.include_usage
            return StreamingResponse(stream(submitted, updates, rid, created, kind, chat, started, sum(len(ids) for ids in prompts), usage,
                                            echoes), media_type="text/event-stream")
        try:
            results = await finished(submitted, updates, http, started)
        finally:
            for engine_request in submitted:
                engine_request.cancelled.set()  # no-op once done; frees the rows if this handler was cancelled
        if results is None:
            return error(499, "the client closed the connection")
        if failed := next((r for r in results if isinstance(r, BaseException)), None):
            return error(500, f"generation failed: {failed}")
        body = []
        for i, result in enumerate(results):
            text = echoes[i] + server.text_of(result)
            body.append({"index": i, **({"message": {"role": "assistant", "content": text}} if chat else {"text": text}),
                         "finish_reason": result.finish_reason,
                         "logprobs": token_logprobs(server.tokenizer, result.tokens, result.logprobs, chat) if result.logprobs else None})
        return {"id": rid, "object": kind, "created": created, "model": server.model_name, "choices": body,
                "usage": token_usage(sum(len(ids) for ids in prompts), sum(len(r.tokens) for r in results))}

    async def finished(submitted: list[EngineRequest], updates: asyncio.Queue, http: Request, started: float):
        """Each choice's Completion (or exception), in order, once all are done; None if the client went
        away first."""
        results, first_at, checked = {}, {}, started
        while len(results) < len(submitted):
            try:
                index, item = await asyncio.wait_for(updates.get(), timeout=DISCONNECT_CHECK_S)
            except asyncio.TimeoutError:
                index, item = None, None
            if time.perf_counter() - checked >= DISCONNECT_CHECK_S:
                checked = time.perf_counter()
                if await http.is_disconnected():  # the client went away: free its rows now
                    return None
            if isinstance(item, tuple):
                results[index] = item[1]
                if not isinstance(item[1], BaseException):
                    observe(item[1], started, first_at.get(index))
            elif item and index not in first_at:
                first_at[index] = time.perf_counter()
                server.metrics.ttft.observe(first_at[index] - started)
        return [results[i] for i in range(len(submitted))]

    def observe(completion: Completion, started: float, first_at: float | None) -> None:
        now = time.perf_counter()
        server.metrics.e2e.observe(now - started)
        server.metrics.prompt_tokens.inc(len(completion.prompt_tokens))
        server.metrics.generation_tokens.inc(len(completion.tokens))
        if first_at is not None and len(completion.tokens) > 1:
            server.metrics.tpot.observe((now - first_at) / (len(completion.tokens) - 1))

    async def stream(submitted: list[EngineRequest], updates: asyncio.Queue, rid, created, kind, chat, started,
                     prompt_tokens: int, include_usage: bool, echoes: list[str]) -> AsyncIterator[str]:
        """SSE chunks of every choice as its tokens are kept (in groups of `smooth_stream`, evenly paced,
        when set), with those tokens' log-probabilities when asked for, after its echoed prompt if any; a
        client that goes away frees its rows at the scheduler's next step."""
        chunk_kind = "chat.completion.chunk" if chat else "text_completion"
        event = lambda body: "data: " + json.dumps({"id": rid, "object": chunk_kind, "created": created,
                                                    "model": server.model_name, **body}) + "\n\n"

        def chunk(index: int, delta: dict, finish: str | None = None) -> str:
            request, choice = submitted[index], choices[index]
            logprobs = None
            if request.logprobs is not None:  # the entries of the tokens received since the last chunk
                logprobs = token_logprobs(server.tokenizer, choice.tokens[choice.logged:],
                                          request.logprobs.window(choice.logged, len(choice.tokens)), chat)
                choice.logged = len(choice.tokens)
            body = {"delta": delta} if chat else {"text": delta.get("content", "")}
            return event({"choices": [{"index": index, "finish_reason": finish, "logprobs": logprobs, **body}]})

        decode = lambda ids: server.tokenizer.decode(ids, skip_special_tokens=True)
        choices = [Streamed(last_burst=started) for _ in submitted]
        results: dict[int, Completion] = {}
        try:
            for index, echo in enumerate(echoes):
                if chat or echo:
                    yield event({"choices": [{"index": index, "finish_reason": None, "logprobs": None,
                                              **({"delta": {"role": "assistant", "content": ""}} if chat else {"text": echo})}]})
            while len(results) < len(submitted):
                index, item = await updates.get()
                request, choice = submitted[index], choices[index]
                if isinstance(item, tuple):
                    result = item[1]
                    if isinstance(result, BaseException):
                        yield "data: " + json.dumps({"error": {"message": str(result), "type": "server_error"}}) + "\n\n"
                        break
                    final = server.text_of(result)
                    yield chunk(index, {"content": final[len(choice.sent):]} if final.startswith(choice.sent) else {}, result.finish_reason)
                    observe(result, started, choice.first_at)
                    results[index] = result
                    continue
                now = time.perf_counter()
                if choice.first_at is None:
                    choice.first_at = now
                    server.metrics.ttft.observe(now - started)
                else:
                    gap = now - choice.last_burst
                    choice.step_s = 0.7 * choice.step_s + 0.3 * gap if choice.step_s else gap
                choice.last_burst = now
                group = server.smooth_stream or len(item)
                groups = [item[i:i + group] for i in range(0, len(item), group)]
                for j, part in enumerate(groups):
                    if j and updates.empty():  # pace the burst over the expected step time, never behind
                        await asyncio.sleep(choice.step_s / len(groups))
                    choice.extend(part, decode)
                    text = settled(choice.text, request.params.stop)
                    if text.startswith(choice.sent) and len(text) > len(choice.sent):  # choice.text holds whole characters only
                        yield chunk(index, {"content": text[len(choice.sent):]})
                        choice.sent = text
            if include_usage and len(results) == len(submitted):
                yield event({"choices": [], "usage": token_usage(prompt_tokens, sum(len(r.tokens) for r in results.values()))})
            yield "data: [DONE]\n\n"
        finally:
            for request in submitted:
                request.cancelled.set()

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, http: Request):
        return await handle(request, chat=False, http=http)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatRequest, http: Request):
        return await handle(request, chat=True, http=http)

    return app


def load_server(bundle: Path, device: str, dtype: str, max_model_len: int, max_batch_size: int = 16,
                adaptive_k: bool = True, smooth_stream: int = 0, target: str | None = None) -> Server:
    """Verify the bundle (the same checks as `draftsmith bundle verify`, with `target` instead of the
    recorded one if given), then load target and draft."""
    from transformers import AutoTokenizer

    from draftsmith.pipeline.bundle import TARGET_JSON, target_dir_of, verify
    from draftsmith.serve.engine import pick_device
    from draftsmith.serve.proposers import read_vocab

    spec = verify(bundle, target)
    target_dir = target_dir_of(bundle, target)
    device = pick_device(device)
    engine = Engine.load(target_dir, bundle / spec["model"], dtype=dtype if device != "cpu" else "float32",
                         device=device, max_batch_size=max_batch_size, draft_vocab=read_vocab(bundle),
                         max_seq_len=max_model_len + spec["num_speculative_tokens"] + 1)
    reference = bundle / TARGET_JSON
    name = json.loads(reference.read_text())["name_or_path"] if reference.is_file() else target_dir.name
    return Server(engine, AutoTokenizer.from_pretrained(target_dir), str(name), spec["num_speculative_tokens"],
                  max_model_len, adaptive_k, smooth_stream)
