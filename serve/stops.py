"""When a sequence ends: max new tokens, EOS and stop token ids, stop strings.

Stop strings are matched by an Aho-Corasick automaton over all of a request's stop strings, fed the text
as it grows: the time is linear in the text and the stop strings together, however many and however long
they are (a search of the whole text per token for each stop string took the square of the length). Its
state also says how much of the text's end could still begin a stop string: what a stream holds back.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from draftsmith.serve.sampling import SamplingParams

Detokenize = Callable[[list[int]], str]


class StopStrings:
    """The automaton of a set of stop strings. Build it once per request (linear in their total length)
    and give each sequence a `scan()`."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.goto: list[dict[str, int]] = [{}]  # the trie: state -> character -> state
        self.depth = [0]  # characters from the root: the longest suffix of the text that begins a stop string
        self.ends = [0]  # the longest stop string that ends at this state (0: none), following suffix links
        for stop in stops:
            state = 0
            for char in stop:
                if char not in self.goto[state]:
                    self.goto.append({})
                    self.depth.append(self.depth[state] + 1)
                    self.ends.append(0)
                    self.goto[state][char] = len(self.goto) - 1
                state = self.goto[state][char]
            self.ends[state] = max(self.ends[state], len(stop))
        self.fail = [0] * len(self.goto)  # the longest proper suffix of a state's string that is a state too
        queue = deque(self.goto[0].values())
        while queue:
            state = queue.popleft()
            for char, child in self.goto[state].items():
                self.fail[child] = self.next(self.fail[state], char) if state else 0
                self.ends[child] = max(self.ends[child], self.ends[self.fail[child]])
                queue.append(child)

    def next(self, state: int, char: str) -> int:
        while state and char not in self.goto[state]:
            state = self.fail[state]
        return self.goto[state].get(char, 0)

    def scan(self) -> "StopScan":
        return StopScan(self)


@dataclass
class StopScan:
    """One text's progress through the automaton."""
    automaton: StopStrings
    state: int = 0
    length: int = 0  # characters fed
    found: int | None = None  # where the earliest stop string that appeared begins

    def feed(self, text: str) -> int | None:
        """Read more of the text; where the earliest stop string begins once one has appeared (matches that
        end in the same piece of text: the one that starts first), else None."""
        if self.found is not None:
            return self.found
        a = self.automaton
        for char in text:
            self.state = a.next(self.state, char)
            self.length += 1
            if a.ends[self.state]:
                start = self.length - a.ends[self.state]
                self.found = start if self.found is None else min(self.found, start)
        return self.found

    @property
    def held(self) -> int:
        """Characters at the text's end that could still begin a stop string."""
        return self.automaton.depth[self.state]


@dataclass
class IncrementalText:
    """A token sequence's text as it grows, decoding only from the last decode's start (decoding the whole
    sequence each time costs its length in time; the overlap keeps spacing and merged bytes right), less a
    last character still cut in two."""
    decode: Detokenize
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    decoded: int = 0  # tokens whose text is in `text`
    window: int = 0  # where the last decode began: the text of tokens[window:decoded] is known

    def extend(self, tokens: list[int]) -> str:
        """Take more tokens; return the text they added (maybe empty, until a character is whole)."""
        self.tokens += tokens
        known = self.decode(self.tokens[self.window:self.decoded])
        both = self.decode(self.tokens[self.window:])
        if len(both) <= len(known) or both.endswith("\ufffd"):
            return ""
        added = both[len(known):]
        self.text += added
        self.window, self.decoded = self.decoded, len(self.tokens)
        return added


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
        if self.params.stop:
            automaton = self.params.stop_automaton or StopStrings(self.params.stop)
            self._text, self._scan = IncrementalText(self.detokenize), automaton.scan()

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
            if self.params.stop and self._hit_stop_string(token):
                self.finish_reason = "stop"
            elif len(self.tokens) >= self.params.max_new_tokens:
                self.finish_reason = "length"
        return kept

    def _hit_stop_string(self, token: int) -> bool:
        at = self._scan.feed(self._text.extend([token]))
        if at is not None:
            self.text = self._text.text[:at]
        return at is not None
