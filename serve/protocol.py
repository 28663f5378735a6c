"""The OpenAI API's request and response shapes: the completions and chat request models, with the checks
that refuse what this server would otherwise answer differently than asked, and the response pieces
(usage, log-probabilities, the error object)."""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from draftsmith.serve.engine import Logprobs
from draftsmith.serve.sampling import SamplingParams

MAX_TOP_LOGPROBS = 20  # as vLLM's default max_logprobs
MAX_N = 64  # choices per request: each is a row of the running batch
INT64 = (-(2**63), 2**63 - 1)  # a seed seeds a torch generator: a signed 64-bit integer


class Strict(BaseModel):
    """Fields take their own JSON type only: `true` is no integer, "yes" no boolean; NaN and infinity are no number."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False)


class StreamOptions(Strict):
    include_usage: bool = False


class Sampling(Strict):
    """The sampling fields both endpoints take; null means the default, as in OpenAI's API."""

    ECHOES: ClassVar[bool] = False  # `echo` (the prompt before the completion): the completions API only
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)  # None: the rest of the context (OpenAI and vLLM do the same)
    max_completion_tokens: int | None = Field(None, ge=1)  # the newer name of max_tokens
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=2**31 - 1)  # vLLM's extension: -1 or 0 turn it off
    min_p: float | None = Field(None, ge=0.0, le=1.0)  # vLLM's extension: 0 turns it off
    seed: int | None = Field(None, ge=INT64[0], le=INT64[1])  # the request's own generator: the same seed, the same text
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0)  # vLLM's extension: 1 turns it off
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None  # token id -> added to its logit
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
        logprobs, top = self.wanted_logprobs()
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=max(self.top_k or 0, 0),
            min_p=self.min_p or 0.0,
            seed=self.seed,
            max_new_tokens=max_new_tokens,
            stop=tuple(self.stops()),
            logprobs=logprobs,
            top_logprobs=top,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=tuple((int(token), bias) for token, bias in (self.logit_bias or {}).items()),
        )

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def unsupported(self) -> tuple[str, str] | None:
        """(parameter, why) for a request this server would otherwise answer differently than asked."""
        n = self.n or 1
        if n > MAX_N:
            return "n", f"at most {MAX_N} choices per request"
        if self.seed is not None and self.seed + n - 1 > INT64[1]:
            return "seed", f"choice i samples with seed + i: seed + n - 1 must be at most 2^63 - 1 ({INT64[1]})"
        if bad := next((token for token in self.logit_bias or {} if not token.isdigit()), None):
            return "logit_bias", f"its keys are token ids (non-negative integers as strings), not {bad!r}"
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

    def prompt_chars(self) -> int:
        """The characters (or token ids) of its prompts: the tokenizer's work."""
        return sum(len(p) for p in self.prompts())


def several(prompt: str | list) -> list:
    """The prompts of a completions request's `prompt`: one (a string or token ids) or a list of them."""
    return prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else [prompt]


class TextPart(Strict):
    type: Literal["text"]
    text: str


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart]

    def as_dict(self) -> dict:
        """The message as a chat template reads it: content parts joined; developer is a system message."""
        content = self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)

    def prompt_chars(self) -> int:
        """The characters of its messages: the chat template's and the tokenizer's work."""
        return sum(len(m.as_dict()["content"]) for m in self.messages)


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


def chat_token_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The token ids of a chat under the target's own template, ready for the assistant's turn: what the data
    stage, the server, the benchmarks and the registered model all send, so that a template's own additions (a
    default system prompt, as Qwen's adds when there is none) are the same everywhere."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
