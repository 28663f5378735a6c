"""The HTTP routes: the OpenAI endpoints (completions and chat, whole or streamed), the model list, and the
health, readiness and metrics endpoints; every error in OpenAI's error shape."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from draftsmith.serve.engine import EngineError
from draftsmith.serve.protocol import MAX_N, ChatRequest, CompletionRequest, error, invalid_unicode, token_logprobs, token_usage
from draftsmith.serve.sampling import SamplingError, SamplingParams
from draftsmith.serve.scheduler import Request as EngineRequest
from draftsmith.serve.stops import StopStrings
from draftsmith.serve.streaming import Reply, stream

if TYPE_CHECKING:
    from draftsmith.serve.server import Server

DISCONNECT_CHECK_S = 0.25  # how often a waiting non-streaming request looks for its client
INLINE_PROMPT_CHARS = 1024  # prompts up to this long are tokenized on the event loop (0.7 ms on a slow CPU core)
TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict"}  # what pydantic calls a union's members in an error's path
# builds the stop strings' automata, one request's at a time: a build is Python work that holds the interpreter
# lock, and many at once in many threads kept the event loop (and /health) waiting for it in turn
STOP_BUILDER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stop-strings")


def add_error_handlers(app: FastAPI) -> None:
    from starlette.exceptions import HTTPException

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":  # its loc is a character offset, not a parameter
            return error(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}")
        # the parameter's path, without pydantic's names of a union's member types ("prompt.list[int].0")
        path = [str(p) for p in first.get("loc", ())[1:] if isinstance(p, int) or p.isidentifier() and p not in TYPE_TAGS]
        param = ".".join(path) or None
        message = first.get("msg", "invalid request")
        if len(exc.errors()) > 1 and all(e.get("loc", ())[:2] == first.get("loc", ())[:2] for e in exc.errors()):
            message = "not of a type this parameter takes (" + "; ".join(sorted({e["msg"] for e in exc.errors()})) + ")"
        return error(400, f"{param or 'body'}: {message}", param)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:  # 404, 405 and the like
        return error(exc.status_code, str(exc.detail), code={404: "not_found", 405: "method_not_allowed"}.get(exc.status_code))


def add_routes(app: FastAPI, server: "Server") -> None:
    @app.get("/health")
    async def health() -> JSONResponse:
        if server.failed is not None:
            return JSONResponse(status_code=500, content={"status": "failed", "error": server.failure})
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready() -> JSONResponse:
        content = {"ready": server.ready} | ({"error": server.failure} if server.failed else {})
        return JSONResponse(status_code=200 if server.ready else 503, content=content)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return PlainTextResponse(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    model_card = lambda: {
        "id": server.model_name,
        "object": "model",
        "owned_by": "draftsmith",
        "created": 0,
        "max_model_len": server.max_model_len,
    }

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != server.model_name:
            return unknown_model(server, model_id)
        return model_card()

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, http: Request):
        return await handle(server, request, chat=False, http=http)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatRequest, http: Request):
        return await handle(server, request, chat=True, http=http)


def unknown_model(server: "Server", name: str) -> JSONResponse:
    return error(404, f"the model {name!r} does not exist: this server serves {server.model_name!r}", "model", "model_not_found")


def stop_refusal(server: "Server", request: CompletionRequest | ChatRequest) -> JSONResponse | None:
    """The 400 for more or longer stop strings than the server's limits (--max-stop-strings,
    --max-stop-string-chars): each costs every request a share of the time it takes to match them."""
    stops = request.stops()
    if len(stops) > server.max_stop_strings:
        return error(400, f"stop: {len(stops)} stop strings; at most {server.max_stop_strings}", "stop")
    if (longest := max((len(stop) for stop in stops), default=0)) > server.max_stop_chars:
        return error(400, f"stop: a stop string of {longest} characters; at most {server.max_stop_chars}", "stop")
    if "" in stops:
        return error(400, "stop: an empty stop string would stop before the first token", "stop")
    return None


def token_refusal(server: "Server", request: CompletionRequest | ChatRequest, prompts: list[list[int]]) -> JSONResponse | None:
    """The 400 for token ids outside the target's vocabulary, naming the prompt or the logit_bias key."""
    vocab = server.vocab_size
    for i, ids in enumerate(prompts):
        if ids and (min(ids) < 0 or max(ids) >= vocab):
            where = f"prompt {i}" if len(prompts) > 1 else "the prompt"
            return error(400, f"{where} has token ids outside the vocabulary [0, {vocab})", "prompt")
    if outside := [token for token in request.logit_bias or {} if int(token) >= vocab]:
        return error(400, f"logit_bias: token {outside[0]} is outside the vocabulary [0, {vocab})", "logit_bias")
    return None


def choices_of(
    server: "Server", request: CompletionRequest | ChatRequest, chat: bool, prompts: list[list[int]], automaton: StopStrings | None
) -> list[tuple[list[int], SamplingParams]] | JSONResponse:
    """(prompt ids, params) of each choice: n for each prompt, each a row of the batch; or the 400 that
    refuses the request."""
    asked = "max_completion_tokens" if request.max_completion_tokens else "max_tokens"
    jobs = []
    for ids in prompts:
        room = server.max_model_len - len(ids)
        new_tokens = request.max_new_tokens(room)
        if room < 1 or new_tokens > room:
            return error(
                400,
                f"{len(ids)} prompt tokens + {asked} {new_tokens} exceed the context of {server.max_model_len} tokens",
                asked if room >= 1 else ("messages" if chat else "prompt"),
            )
        try:
            params = replace(request.params(new_tokens), stop_automaton=automaton)
        except SamplingError as e:
            return error(400, str(e))
        # with a seed, a prompt's choice i samples with seed + i
        jobs += [(ids, params if params.seed is None or i == 0 else replace(params, seed=params.seed + i)) for i in range(request.n or 1)]
    if len(jobs) > MAX_N:
        return error(400, f"n: at most {MAX_N} choices per request (prompts x n)", "n")
    return jobs


async def handle(server: "Server", request: CompletionRequest | ChatRequest, chat: bool, http: Request):
    if request.model is not None and request.model != server.model_name:
        return unknown_model(server, request.model)
    if (where := invalid_unicode(request.model_dump())) is not None:
        return error(400, f"{where}: not valid Unicode (a lone surrogate)", where)
    if unsupported := request.unsupported():
        return error(400, f"{unsupported[0]}: {unsupported[1]}", unsupported[0])
    if refused := stop_refusal(server, request):
        return refused
    # tokenizing a long prompt and building the stop strings' automaton must not stall the loop; a short prompt
    # (a fraction of a millisecond) is tokenized here, which saves the thread's hops on every request's way in
    prompts = (
        server.prompt_ids(request) if request.prompt_chars() <= INLINE_PROMPT_CHARS else await asyncio.to_thread(server.prompt_ids, request)
    )
    if refused := token_refusal(server, request, prompts):
        return refused
    automaton = (
        await asyncio.get_running_loop().run_in_executor(STOP_BUILDER, StopStrings, tuple(request.stops())) if request.stop else None
    )
    jobs = choices_of(server, request, chat, prompts, automaton)
    if isinstance(jobs, JSONResponse):
        return jobs
    # echo: each choice's text starts with its prompt (token ids decoded, off the event loop)
    echo = lambda: [p if isinstance(p, str) else server.tokenizer.decode(p) for p in request.prompts() for _ in range(request.n or 1)]
    echoes = await asyncio.to_thread(echo) if request.echo else [""] * len(jobs)
    reply = Reply.new(chat)
    submitted, updates = [], asyncio.Queue()
    try:
        for index, (ids, params) in enumerate(jobs):
            submitted.append(server.submit(ids, params, updates, index))
    except EngineError as e:
        for engine_request in submitted:
            engine_request.cancelled.set()
        return error(400, str(e))
    prompt_tokens = sum(len(ids) for ids in prompts)
    if request.stream:
        usage = request.stream_options is not None and request.stream_options.include_usage
        return StreamingResponse(stream(server, reply, submitted, updates, prompt_tokens, usage, echoes), media_type="text/event-stream")
    try:
        results = await finished(server, submitted, updates, http, reply.started)
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
        body.append(
            {
                "index": i,
                **({"message": {"role": "assistant", "content": text}} if chat else {"text": text}),
                "finish_reason": result.finish_reason,
                "logprobs": token_logprobs(server.tokenizer, result.tokens, result.logprobs, chat) if result.logprobs else None,
            }
        )
    return {
        "id": reply.id,
        "object": reply.kind,
        "created": reply.created,
        "model": server.model_name,
        "choices": body,
        "usage": token_usage(prompt_tokens, sum(len(r.tokens) for r in results)),
    }


async def finished(server: "Server", submitted: list[EngineRequest], updates: asyncio.Queue, http: Request, started: float):
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
                server.metrics.observe_request(
                    len(item[1].prompt_tokens), len(item[1].tokens), started, first_at.get(index), time.perf_counter()
                )
        elif item and index not in first_at:
            first_at[index] = time.perf_counter()
            server.metrics.ttft.observe(first_at[index] - started)
    return [results[i] for i in range(len(submitted))]
