"""The HTTP routes: the OpenAI endpoints (completions and chat, whole or streamed), the model list, and the
health, readiness and metrics endpoints; every error in OpenAI's error shape."""
from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from draftsmith.serve.engine import EngineError
from draftsmith.serve.protocol import (MAX_N, ChatRequest, CompletionRequest, error, invalid_unicode, token_logprobs,
                                       token_usage)
from draftsmith.serve.sampling import SamplingError, SamplingParams
from draftsmith.serve.scheduler import Request as EngineRequest
from draftsmith.serve.streaming import Reply, stream

if TYPE_CHECKING:
    from draftsmith.serve.server import Server

DISCONNECT_CHECK_S = 0.25  # how often a waiting non-streaming request looks for its client


def add_error_handlers(app: FastAPI) -> None:
    from starlette.exceptions import HTTPException

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


def add_routes(app: FastAPI, server: "Server") -> None:
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


def choices_of(server: "Server", request: CompletionRequest | ChatRequest, chat: bool,
               prompts: list[list[int]]) -> list[tuple[list[int], SamplingParams]] | JSONResponse:
    """(prompt ids, params) of each choice: n for each prompt, each a row of the batch; or the 400 that
    refuses the request."""
    asked = "max_completion_tokens" if request.max_completion_tokens else "max_tokens"
    jobs = []
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
    return jobs


async def handle(server: "Server", request: CompletionRequest | ChatRequest, chat: bool, http: Request):
    if request.model is not None and request.model != server.model_name:
        return unknown_model(server, request.model)
    if (where := invalid_unicode(request.model_dump())) is not None:
        return error(400, f"{where}: not valid Unicode (a lone surrogate)", where)
    if unsupported := request.unsupported():
        return error(400, f"{unsupported[0]}: {unsupported[1]}", unsupported[0])
    prompts = await asyncio.to_thread(server.prompt_ids, request)  # tokenizing a long prompt must not stall the loop
    jobs = choices_of(server, request, chat, prompts)
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
        return StreamingResponse(stream(server, reply, submitted, updates, prompt_tokens, usage, echoes),
                                 media_type="text/event-stream")
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
        body.append({"index": i, **({"message": {"role": "assistant", "content": text}} if chat else {"text": text}),
                     "finish_reason": result.finish_reason,
                     "logprobs": token_logprobs(server.tokenizer, result.tokens, result.logprobs, chat) if result.logprobs else None})
    return {"id": reply.id, "object": reply.kind, "created": reply.created, "model": server.model_name, "choices": body,
            "usage": token_usage(prompt_tokens, sum(len(r.tokens) for r in results))}


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
                server.metrics.observe_request(len(item[1].prompt_tokens), len(item[1].tokens), started, first_at.get(index),
                                               time.perf_counter())
        elif item and index not in first_at:
            first_at[index] = time.perf_counter()
            server.metrics.ttft.observe(first_at[index] - started)
    return [results[i] for i in range(len(submitted))]
