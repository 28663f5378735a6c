"""When a sequence ends: max new tokens, EOS and stop token ids, stop strings.

Stop strings are matched by an Aho-Corasick automaton over all of a request's stop strings, fed the text
as it grows: the time is linear in the text and the stop strings together, however many and however long
they are (a search of the whole text per token for each stop string took the square of the length). Its
state also says how much of the text's end could still begin a stop string: what a stream holds back.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from draftsmith.serve.sampling import SamplingParams

Detokenize = Callable[[list[int]], str]
CHARS = 0x110000  # code points: a transition's key is state * CHARS + the character's code point


class StopStrings:
    """The automaton of a set of stop strings. Build it once per request (linear in their total length)
    and give each sequence a `scan()`. Its transitions are one dict of integers, not a dict per state: a
    request may send 64 x 4096 characters of stop strings, and a quarter of a million small dicts cost the
    garbage collector's every pass over the server's objects."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        edges: dict[int, int] = {}  # state * CHARS + code point -> the next state along the trie
        parent, code, depth, ends = [0], [0], [0], [0]
        for stop in stops:
            state = 0
            for char in stop:
                key = state * CHARS + ord(char)
                child = edges.get(key)
                if child is None:
                    child = edges[key] = len(depth)
                    parent.append(state)
                    code.append(ord(char))
                    depth.append(depth[state] + 1)
                    ends.append(0)
                state = child
            ends[state] = max(ends[state], len(stop))
            time.sleep(0)  # a build holds the interpreter lock: let the server's other threads in between stop strings
        # the suffix links, shallowest states first: the longest proper suffix of a state's string that is a
        # state too; `ends` then holds the longest stop string ending at each state, through those links
        fail = [0] * len(depth)
        by_depth: list[list[int]] = [[] for _ in range(max(depth) + 1)]
        for state in range(1, len(depth)):
            by_depth[depth[state]].append(state)
        for states in by_depth[2:]:
            time.sleep(0)
            for state in states:
                f, c = fail[parent[state]], code[state]
                while f and f * CHARS + c not in edges:
                    f = fail[f]
                fail[state] = edges.get(f * CHARS + c, 0)
                ends[state] = max(ends[state], ends[fail[state]])
        self.edges, self.fail, self.depth, self.ends = edges, fail, depth, ends

    def next(self, state: int, char: str) -> int:
        c, edges = ord(char), self.edges
        while state and state * CHARS + c not in edges:
            state = self.fail[state]
        return edges.get(state * CHARS + c, 0)

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
        known = self.decode(self.tokens[self.window : self.decoded])
        both = self.decode(self.tokens[self.window :])
        if len(both) <= len(known) or both.endswith("\ufffd"):
            return ""
        added = both[len(known) :]
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
