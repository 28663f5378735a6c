"""`draftsmith serve`: an OpenAI-compatible HTTP server over the engine, speculative with the bundle's K.

Endpoints: /v1/completions, /v1/chat/completions (the target's chat template), both with SSE
streaming in OpenAI's chunk format; /v1/models, /health, /ready, /metrics (Prometheus; the spec-decode
counters of DESIGN.md under vLLM's names with our prefix). Requests run one at a time on one worker
thread, each as a batch of one (no continuous batching yet). Bad input gets a 4xx with an
OpenAI-style error body and the server keeps serving.
"""
from __future__ import annotations

import asyncio
import json
import queue
import threading
import time
import uuid
from contextlib import asynccontextmanager
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, Field

from draftsmith.serve.engine import Engine, EngineError
from draftsmith.serve.sampling import SamplingError, SamplingParams

PREFIX = "draftsmith:"


class BundleSourceError(ValueError):
    """`draftsmith serve` was given something that is neither a bundle dir nor a models:/ URI."""


def resolve_bundle(source: str, tracking_uri: str | None = None) -> Path:
    """A bundle dir, or the bundle inside a registered model (`models:/<name>@<alias>` or `/<version>`)."""
    if source.startswith("models:/"):
        import mlflow

        if tracking_uri:
            mlflow.set_tracking_uri(tracking_uri)
            mlflow.set_registry_uri(tracking_uri)
        local = Path(mlflow.artifacts.download_artifacts(artifact_uri=source))
        found = [p.parent for p in local.rglob("manifest.json") if p.parent.name == "bundle"]
        if not found:
            raise BundleSourceError(f"{source} holds no draftsmith bundle")
        return found[0]
    path = Path(source)
    if not path.is_dir():
        raise BundleSourceError(f"{source}: no such bundle dir (or give models:/<name>@champion)")
    return path


class Cancelled(Exception):
    """The streaming client went away: the engine stops at its next step and frees the slot."""


class Sampling(BaseModel):
    model: str | None = None
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False

    def params(self) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, seed=self.seed,
                              max_new_tokens=self.max_tokens, stop=tuple(stop))


class CompletionRequest(Sampling):
    prompt: str = Field(min_length=1)


class Message(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)


def error(status: int, message: str, param: str | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse(status_code=status, content={"error": {"message": message, "type": kind, "param": param, "code": None}})


class Metrics:
    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        spec = lambda name, doc, *labels: Counter(f"{PREFIX}spec_decode_{name}", doc, labels, registry=self.registry)
        self.drafts = spec("num_drafts", "speculative verification steps")
        self.draft_tokens = spec("num_draft_tokens", "tokens proposed by the draft")
        self.accepted = spec("num_accepted_tokens", "draft tokens the target accepted")
        self.accepted_per_pos = spec("num_accepted_tokens_per_pos", "accepted draft tokens by position", "position")
        self.running = Gauge(f"{PREFIX}num_requests_running", "requests being generated", registry=self.registry)
        self.waiting = Gauge(f"{PREFIX}num_requests_waiting", "requests queued", registry=self.registry)
        hist = lambda name, doc: Histogram(f"{PREFIX}{name}", doc, registry=self.registry,
                                           buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        self.ttft = hist("time_to_first_token_seconds", "time to first token")
        self.tpot = hist("time_per_output_token_seconds", "time per output token after the first")
        self.e2e = hist("e2e_request_latency_seconds", "end-to-end request latency")


class Server:
    def __init__(self, engine: Engine, tokenizer, model_name: str, num_speculative_tokens: int, max_model_len: int):
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.k, self.max_model_len = num_speculative_tokens, max_model_len
        self.metrics = Metrics()
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self.ready = False

    def warm_up(self) -> None:
        """Load-time work before /ready: one short generation (captures the decode graphs on a GPU)."""
        self.engine.generate([self.tokenizer.encode("Hello")], SamplingParams(max_new_tokens=2), self.k)
        self.ready = True

    def prompt_ids(self, request: CompletionRequest | ChatRequest) -> list[int]:
        if isinstance(request, ChatRequest):
            ids = self.tokenizer.apply_chat_template([m.model_dump() for m in request.messages], add_generation_prompt=True)
            return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        return self.tokenizer.encode(request.prompt)

    def generate(self, ids: list[int], params: SamplingParams, on_tokens=None):
        """On the engine's thread: one request; spec counters go to /metrics."""
        self.metrics.waiting.dec()
        self.metrics.running.inc()
        try:
            generation = self.engine.generate([ids], params, self.k, on_tokens=on_tokens)
        finally:
            self.metrics.running.dec()
        stats = generation.stats
        self.metrics.drafts.inc(stats.num_drafts)
        self.metrics.draft_tokens.inc(stats.num_draft_tokens)
        self.metrics.accepted.inc(stats.num_accepted_tokens)
        for position, accepted in enumerate(stats.accepted_per_position):
            self.metrics.accepted_per_pos.labels(position=str(position)).inc(accepted)
        return generation.completions[0]

    def text_of(self, completion) -> str:
        return completion.text if completion.text is not None else self.tokenizer.decode(completion.tokens, skip_special_tokens=True)


def create_app(server: Server, api_key: str | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.worker.submit(server.warm_up)  # on the engine's thread: requests wait behind it; /ready tells
        yield

    app = FastAPI(title="draftsmith", lifespan=lifespan)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return error(400, f"{param or 'body'}: {first.get('msg', 'invalid request')}", param)

    @app.middleware("http")
    async def authorize(request: Request, call_next):
        if api_key and request.url.path.startswith("/v1/") and request.headers.get("authorization") != f"Bearer {api_key}":
            return error(401, "missing or wrong API key (Authorization: Bearer <key>)")
        return await call_next(request)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        return JSONResponse(status_code=200 if server.ready else 503, content={"ready": server.ready})

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return PlainTextResponse(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": server.model_name, "object": "model", "owned_by": "draftsmith",
                                            "created": 0, "max_model_len": server.max_model_len}]}

    async def handle(request: CompletionRequest | ChatRequest, chat: bool):
        try:
            params = request.params()
        except SamplingError as e:
            return error(400, str(e))
        ids = server.prompt_ids(request)
        if len(ids) + request.max_tokens > server.max_model_len:
            return error(400, f"{len(ids)} prompt tokens + max_tokens {request.max_tokens} exceed the context of "
                              f"{server.max_model_len} tokens", "max_tokens")
        rid, created = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}", int(time.time())
        kind = "chat.completion" if chat else "text_completion"
        started = time.perf_counter()
        server.metrics.waiting.inc()
        if request.stream:
            return StreamingResponse(stream(ids, params, rid, created, kind, chat, started), media_type="text/event-stream")
        try:
            completion = await asyncio.get_running_loop().run_in_executor(server.worker, server.generate, ids, params)
        except EngineError as e:
            return error(400, str(e))
        server.metrics.e2e.observe(time.perf_counter() - started)
        text = server.text_of(completion)
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}} if chat else {"index": 0, "text": text})
        usage = {"prompt_tokens": len(ids), "completion_tokens": len(completion.tokens),
                 "total_tokens": len(ids) + len(completion.tokens)}
        return {"id": rid, "object": kind, "created": created, "model": server.model_name,
                "choices": [{**choice, "finish_reason": completion.finish_reason, "logprobs": None}], "usage": usage}

    async def stream(ids, params, rid, created, kind, chat, started) -> Iterator[str]:
        """SSE chunks as tokens are kept; a client that goes away stops the generation at its next step."""
        updates: queue.Queue = queue.Queue()
        cancelled = threading.Event()

        def on_tokens(row: int, tokens: list[int]) -> None:
            if cancelled.is_set():
                raise Cancelled
            updates.put(tokens)

        def work():
            try:
                updates.put(("done", server.generate(ids, params, on_tokens)))
            except BaseException as e:  # noqa: BLE001 - reported to the client as an error chunk
                updates.put(("error", e))

        future = asyncio.get_running_loop().run_in_executor(server.worker, work)
        chunk_kind = "chat.completion.chunk" if chat else "text_completion"
        chunk = lambda delta, finish=None: "data: " + json.dumps({
            "id": rid, "object": chunk_kind, "created": created, "model": server.model_name,
            "choices": [{"index": 0, "finish_reason": finish, "logprobs": None,
                         **({"delta": delta} if chat else {"text": delta.get("content", "")})}]}) + "\n\n"
        tokens: list[int] = []
        sent = ""
        first, first_at = True, started
        try:
            if chat:
                yield chunk({"role": "assistant", "content": ""})
            while True:
                item = await asyncio.get_running_loop().run_in_executor(None, updates.get)
                if isinstance(item, tuple):
                    status, value = item
                    if status == "error":
                        yield "data: " + json.dumps({"error": {"message": str(value), "type": "server_error"}}) + "\n\n"
                        break
                    final = server.text_of(value)
                    yield chunk({"content": final[len(sent):]} if final.startswith(sent) else {}, value.finish_reason)
                    server.metrics.e2e.observe(time.perf_counter() - started)
                    if len(value.tokens) > 1:
                        server.metrics.tpot.observe((time.perf_counter() - first_at) / (len(value.tokens) - 1))
                    break
                if first:
                    first_at = time.perf_counter()
                    server.metrics.ttft.observe(first_at - started)
                    first = False
                tokens += item
                text = server.tokenizer.decode(tokens, skip_special_tokens=True)
                if text.startswith(sent) and len(text) > len(sent) and not text.endswith("\ufffd"):
                    yield chunk({"content": text[len(sent):]})
                    sent = text
            yield "data: [DONE]\n\n"
        finally:
            cancelled.set()
            await future

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatRequest):
        return await handle(request, chat=True)

    return app


def load_server(bundle: Path, device: str, dtype: str, max_model_len: int) -> Server:
    """Verify the bundle (the same checks as `draftsmith bundle verify`), then load target and draft."""
    from transformers import AutoTokenizer

    from draftsmith.pipeline.bundle import TARGET_JSON, target_dir_of, verify
    from draftsmith.serve.engine import pick_device

    spec = verify(bundle)
    target_dir = target_dir_of(bundle)
    device = pick_device(device)
    engine = Engine.load(target_dir, bundle / spec["model"], dtype=dtype if device != "cpu" else "float32",
                         device=device, max_seq_len=max_model_len + spec["num_speculative_tokens"] + 1)
    reference = bundle / TARGET_JSON
    name = json.loads(reference.read_text())["name_or_path"] if reference.is_file() else target_dir.name
    return Server(engine, AutoTokenizer.from_pretrained(target_dir), str(name), spec["num_speculative_tokens"], max_model_len)
