"""Streaming a reply as server-sent events in OpenAI's chunk format: each choice's text as its tokens are
kept, never a piece that a stop string may still cut away, so streamed and whole replies say the same."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator

from draftsmith.serve.engine import Completion
from draftsmith.serve.protocol import token_logprobs, token_usage
from draftsmith.serve.scheduler import Request as EngineRequest
from draftsmith.serve.stops import IncrementalText, StopScan, StopStrings

if TYPE_CHECKING:
    from draftsmith.serve.server import Server


@dataclass(frozen=True)
class Reply:
    """What every chunk or body of one API response carries."""

    chat: bool
    id: str
    created: int
    started: float  # perf_counter at the request's arrival

    @classmethod
    def new(cls, chat: bool) -> "Reply":
        return cls(chat, f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}", int(time.time()), time.perf_counter())

    @property
    def kind(self) -> str:
        return "chat.completion" if self.chat else "text_completion"


@dataclass
class Streamed:
    """One choice of a stream: its text as it grows, what stop strings still hold back, and what went out."""

    text: IncrementalText
    scan: StopScan | None  # the request's stop strings over this choice's text (None: it has none)
    sent: str = ""  # text sent
    logged: int = 0  # tokens whose log-probabilities were sent
    first_at: float | None = None
    last_burst: float = 0.0
    step_s: float = 0.0  # a moving average of the time between bursts: the pacing budget

    def burst(self, now: float) -> bool:
        """Tokens arrived at `now`: the pacing budget follows the time between bursts. Whether they are the first."""
        first = self.first_at is None
        if first:
            self.first_at = now
        else:
            gap = now - self.last_burst
            self.step_s = 0.7 * self.step_s + 0.3 * gap if self.step_s else gap
        self.last_burst = now
        return first

    def extend(self, tokens: list[int]) -> None:
        added = self.text.extend(tokens)
        if self.scan is not None:
            self.scan.feed(added)

    def settled(self) -> str:
        """What of the text no stop string can still cut away: the text before the stop string that appeared,
        or less the tail that could begin one. Streaming only this makes stream and non-stream text equal."""
        text = self.text.text
        if self.scan is None:
            return text
        return text[: self.scan.found] if self.scan.found is not None else text[: len(text) - self.scan.held]


async def stream(
    server: "Server",
    reply: Reply,
    submitted: list[EngineRequest],
    updates: asyncio.Queue,
    prompt_tokens: int,
    include_usage: bool,
    echoes: list[str],
) -> AsyncIterator[str]:
    """SSE chunks of every choice as its tokens are kept (in groups of `smooth_stream`, evenly paced,
    when set), with those tokens' log-probabilities when asked for, after its echoed prompt if any; a
    client that goes away frees its rows at the scheduler's next step."""
    chat, started = reply.chat, reply.started
    chunk_kind = "chat.completion.chunk" if chat else "text_completion"
    event = lambda body: (
        "data: " + json.dumps({"id": reply.id, "object": chunk_kind, "created": reply.created, "model": server.model_name, **body}) + "\n\n"
    )

    def chunk(index: int, delta: dict, finish: str | None = None) -> str:
        request, choice = submitted[index], choices[index]
        logprobs = None
        if request.logprobs is not None:  # the entries of the tokens received since the last chunk
            tokens = choice.text.tokens
            logprobs = token_logprobs(server.tokenizer, tokens[choice.logged :], request.logprobs.window(choice.logged, len(tokens)), chat)
            choice.logged = len(tokens)
        body = {"delta": delta} if chat else {"text": delta.get("content", "")}
        return event({"choices": [{"index": index, "finish_reason": finish, "logprobs": logprobs, **body}]})

    decode = lambda ids: server.tokenizer.decode(ids, skip_special_tokens=True)
    scan = lambda params: (params.stop_automaton or StopStrings(params.stop)).scan() if params.stop else None
    choices = [Streamed(IncrementalText(decode), scan(request.params), last_burst=started) for request in submitted]
    results: dict[int, Completion] = {}
    pending: deque = deque()  # (index, item) taken from `updates`, in order
    try:
        for index, echo in enumerate(echoes):
            if chat or echo:
                opening = {"delta": {"role": "assistant", "content": ""}} if chat else {"text": echo}
                yield event({"choices": [{"index": index, "finish_reason": None, "logprobs": None, **opening}]})
        while len(results) < len(submitted):
            if not pending:
                pending.append(await updates.get())
            while not updates.empty():
                pending.append(updates.get_nowait())
            index, item = pending.popleft()
            while not isinstance(item, tuple) and pending and pending[0][0] == index and not isinstance(pending[0][1], tuple):
                # a loop behind the engine sends this choice's waiting steps as one chunk, not one a step: the
                # busier the server, the less work a token costs it
                item = item + pending.popleft()[1]
            request, choice = submitted[index], choices[index]
            if isinstance(item, tuple):
                result = item[1]
                if isinstance(result, BaseException):
                    yield "data: " + json.dumps({"error": {"message": str(result), "type": "server_error"}}) + "\n\n"
                    break
                final = server.text_of(result)
                yield chunk(index, {"content": final[len(choice.sent) :]} if final.startswith(choice.sent) else {}, result.finish_reason)
                server.metrics.observe_request(len(result.prompt_tokens), len(result.tokens), started, choice.first_at, time.perf_counter())
                results[index] = result
                continue
            if choice.burst(time.perf_counter()):
                server.metrics.ttft.observe(choice.first_at - started)
            group = server.smooth_stream or len(item)
            groups = [item[i : i + group] for i in range(0, len(item), group)]
            for j, part in enumerate(groups):
                if j and not pending and updates.empty():  # pace the burst over the expected step time, never behind
                    await asyncio.sleep(choice.step_s / len(groups))
                choice.extend(part)
                text = choice.settled()
                if text.startswith(choice.sent) and len(text) > len(choice.sent):  # the text holds whole characters only
                    yield chunk(index, {"content": text[len(choice.sent) :]})
                    choice.sent = text
        if include_usage and len(results) == len(submitted):
            yield event({"choices": [], "usage": token_usage(prompt_tokens, sum(len(r.tokens) for r in results.values()))})
        yield "data: [DONE]\n\n"
    finally:
        for request in submitted:
            request.cancelled.set()
