"""When a sequence ends: max new tokens, EOS and stop token ids, stop strings."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from draftsmith.serve.sampling import SamplingParams

Detokenize = Callable[[list[int]], str]


@dataclass
class StopChecker:
    params: SamplingParams
    eos_token_ids: frozenset[int]
    detokenize: Detokenize | None = None
    tokens: list[int] = field(default_factory=list)
    text: str | None = None  # set when a stop string ended the sequence: the text before it
    finish_reason: str | None = None  # "stop" or "length"

    def __post_init__(self) -> None:
        if self.params.stop and self.detokenize is None:
            raise ValueError("stop strings need a tokenizer to detokenize with")
        self._stop_ids = frozenset(self.params.stop_token_ids) | (frozenset() if self.params.ignore_eos else self.eos_token_ids)

    def append(self, new_tokens: list[int]) -> int:
        """Take tokens in order until the sequence ends; return how many were kept."""
        kept = 0
        for token in new_tokens:
            if self.finish_reason:
                break
            if token in self._stop_ids:
                self.finish_reason = "stop"  # the stop token itself is not part of the output
                break
            self.tokens.append(token)
            kept += 1
            if self.params.stop and self._hit_stop_string():
                self.finish_reason = "stop"
            elif len(self.tokens) >= self.params.max_new_tokens:
                self.finish_reason = "length"
        return kept

    def _hit_stop_string(self) -> bool:
        text = self.detokenize(self.tokens)
        hits = [i for i in (text.find(s) for s in self.params.stop) if i >= 0]
        if hits:
            self.text = text[: min(hits)]
        return bool(hits)
