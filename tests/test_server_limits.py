"""What one request can do to the others, and what the server refuses: stop strings matched in linear time
off the event loop, within limits; wrong types, out-of-range integers and duplicate keys refused with a 4xx in
OpenAI's error shape; oversized chunked bodies answered with 413."""

import json
import random
import threading
import time

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from draftsmith.serve.stops import StopStrings
from tests.test_server import API_KEY, base_url  # noqa: F401 - the running server fixture

HEADERS = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}


def naive(text: str, stops: list[str]) -> tuple[int | None, int]:
    """Where the earliest stop string begins (None: none appears), and how much of the end could begin one."""
    found = min((i for i in (text.find(s) for s in stops) if i >= 0), default=None)
    held = max((n for s in stops for n in range(1, len(s) + 1) if text.endswith(s[:n])), default=0)
    return found, held


@settings(max_examples=300, deadline=None)
@given(
    stops=st.lists(st.text("abc", min_size=1, max_size=6), min_size=1, max_size=5), pieces=st.lists(st.text("abcd", max_size=5), max_size=8)
)
def test_the_automaton_finds_what_a_search_of_the_whole_text_finds(stops, pieces):
    scan, text = StopStrings(tuple(stops)).scan(), ""
    for piece in pieces:
        text += piece
        found = scan.feed(piece)
        expected, held = naive(text, stops)
        if expected is not None:
            # the first piece with a stop string in it decides, as the engine stops at that token
            assert found == expected
            return
        assert found is None and scan.held == held


def post(base, body: dict | str, **headers):
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(f"{base}/v1/completions", content=content, headers={**HEADERS, **headers}, timeout=60)


def test_a_megabyte_stop_string_is_refused_at_once(base_url):  # noqa: F811
    started = time.perf_counter()
    refused = post(base_url, {"prompt": "hi", "max_tokens": 4, "stop": "x" * 1_000_000, "stream": True})
    seconds = time.perf_counter() - started
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "stop", refused.text
    assert "at most 4096" in refused.json()["error"]["message"]
    assert seconds < 1.0, seconds  # refused before any work on it (it took 0.03-0.1 s on a 2-core CI machine under load)
    assert post(base_url, {"prompt": "hi", "max_tokens": 4, "stop": ["a"] * 65}).json()["error"]["param"] == "stop"


def stream_all(base: str, bodies: list[dict]) -> list[tuple[int, str]]:
    """Every body as a streaming request at once, from threads of this process; (status, text) of each."""
    results = []

    def stream(body):
        with httpx.stream("POST", f"{base}/v1/completions", json=body, headers=HEADERS, timeout=120) as response:
            results.append((response.status_code, "".join(response.iter_text())))

    threads = [threading.Thread(target=stream, args=(b,)) for b in bodies]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_long_stop_strings_stall_neither_health_nor_other_requests(base_url):  # noqa: F811
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    draw = random.Random(0)
    stops = lambda: ["".join(draw.choice("abcdefgh ") for _ in range(1000)) for _ in range(50)]
    bodies = [
        {"prompt": "Tell me about fees.", "max_tokens": 24, "temperature": 0.8, "seed": i, "stream": True, "stop": stops()}
        for i in range(16)
    ]
    polls = []
    # the clients in a process of their own, as real clients are: not in the server's interpreter
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as clients, httpx.Client() as poller:
        clients.submit(int).result()  # the process is up before the load starts
        load = clients.submit(stream_all, base_url, bodies)
        while not load.done():
            started = time.perf_counter()
            assert poller.get(f"{base_url}/health", timeout=10).status_code == 200
            polls.append(time.perf_counter() - started)
            time.sleep(0.05)
        results = load.result()
    assert len(results) == 16 and all(status == 200 and text.rstrip().endswith("data: [DONE]") for status, text in results)
    assert len(polls) >= 3 and max(polls) < 0.1, sorted(polls)[-5:]


@pytest.mark.parametrize(
    "body,param",
    [
        ({"prompt": "hi", "seed": 2**64}, "seed"),
        ({"prompt": "hi", "seed": -(2**63) - 1}, "seed"),
        ({"prompt": "hi", "seed": 2**63 - 1, "n": 2}, "seed"),  # choice 1 samples with seed + 1
        ({"prompt": "hi", "top_k": 2**63}, "top_k"),
        ({"prompt": "hi", "max_tokens": True}, "max_tokens"),
        ({"prompt": "hi", "stream": "yes"}, "stream"),
        ({"prompt": [True, False]}, "prompt"),
        ('{"prompt": "hi", "temperature": NaN}', "temperature"),
        ({"prompt": "hi", "logit_bias": {"five": 1.0}}, "logit_bias"),
        ({"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias"),
        ({"prompt": "hi", "logit_bias": {"49152": 1.0}}, "logit_bias"),
        ({"prompt": "hi", "presence_penalty": 2.5}, "presence_penalty"),
        ({"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty"),
        ({"prompt": "hi", "stop": ["a", ""]}, "stop"),
        ({"prompt": [[5, 6], [7, 49152]]}, "prompt"),
    ],
)
def test_each_bad_parameter_gets_a_4xx_naming_it(base_url, body, param):  # noqa: F811
    refused = post(base_url, body)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"], error
    assert "overflow" not in error["message"].lower()


def test_messages_name_the_right_prompt_and_the_right_bound(base_url):  # noqa: F811
    second = post(base_url, {"prompt": [[5, 6], [7, 49152]]}).json()["error"]["message"]
    assert second.startswith("prompt 1 has token ids outside the vocabulary"), second
    nan = post(base_url, '{"prompt": "hi", "temperature": NaN}').json()["error"]["message"]
    assert "finite number" in nan and "2" not in nan, nan


def test_two_authorization_headers_are_refused(base_url):  # noqa: F811
    headers = [("Authorization", "Bearer wrong"), ("Authorization", f"Bearer {API_KEY}"), ("Content-Type", "application/json")]
    refused = httpx.post(f"{base_url}/v1/completions", content=b'{"prompt": "hi", "max_tokens": 2}', headers=headers)
    assert refused.status_code == 400 and "more than one Authorization header" in refused.json()["error"]["message"]


def test_an_oversized_chunked_body_gets_413(base_url):  # noqa: F811
    def chunks():
        yield b'{"prompt": "'
        for _ in range(5):
            yield b"x" * (1 << 20)
        yield b'", "max_tokens": 2}'

    refused = httpx.post(f"{base_url}/v1/completions", content=chunks(), headers=HEADERS, timeout=60)
    assert refused.status_code == 413 and refused.json()["error"]["message"].startswith("the request body is larger")
    assert post(base_url, {"prompt": "hi", "max_tokens": 2}).status_code == 200
