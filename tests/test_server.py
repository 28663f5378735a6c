"""The HTTP server on CPU with a tiny chat target and draft: the official openai client completes and
streams, bad input gets a 4xx with an OpenAI-style body and the server keeps serving, metrics count,
64 streaming clients for a minute end without an error, the alert rules and dashboard query metrics
the server exports, and stream smoothing spreads bursts."""

import asyncio
import json
import re
import socket
import threading
import time

import httpx
import pytest
import torch

from draftsmith.distill.data import heldout_messages
from draftsmith.distill.tokenizer import copy_tokenizer_files
from draftsmith.evaluate.bench_serve import run_level
from draftsmith.serve.engine import Engine
from draftsmith.serve.scheduler import PROBE_EVERY
from draftsmith.serve.server import Server, create_app
from draftsmith.serve.weights import load_model
from tests.conftest import save_truncated_draft, wait_ready

API_KEY = "sk-test"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def base_url(tiny_chat_target, tmp_path_factory):
    import uvicorn
    from transformers import AutoTokenizer

    draft = save_truncated_draft(tiny_chat_target, tmp_path_factory.mktemp("srv") / "draft", keep_layers=1)
    copy_tokenizer_files(tiny_chat_target, draft)
    engine = Engine(
        load_model(tiny_chat_target, torch.float32),
        load_model(draft, torch.float32),
        max_batch_size=16,
        max_seq_len=256,
        eos_token_ids=frozenset({2}),
    )
    server = Server(engine, AutoTokenizer.from_pretrained(tiny_chat_target), "tiny", num_speculative_tokens=3, max_model_len=200)
    port = free_port()
    config = uvicorn.Config(create_app(server, api_key=API_KEY), host="127.0.0.1", port=port, log_level="warning")
    thread = threading.Thread(target=uvicorn.Server(config).run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, timeout=60)
    return url


def client(base_url):
    from openai import OpenAI

    return OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY)


def test_openai_client_completes_and_streams_the_same_greedy_text(base_url):
    openai = client(base_url)
    messages = [{"role": "user", "content": "How do I dispute a card charge?"}]
    whole = openai.chat.completions.create(model="tiny", messages=messages, max_tokens=20, temperature=0)
    assert whole.choices[0].message.content and whole.usage.completion_tokens >= 1
    streamed = openai.chat.completions.create(model="tiny", messages=messages, max_tokens=20, temperature=0, stream=True)
    pieces = [c.choices[0].delta.content or "" for c in streamed]
    assert "".join(pieces) == whole.choices[0].message.content and len(pieces) > 2
    text = openai.completions.create(model="tiny", prompt="Balance inquiry:", max_tokens=8, temperature=0.8, seed=3)
    assert text.choices[0].finish_reason in ("stop", "length")
    assert [m.id for m in openai.models.list().data] == ["tiny"]


@pytest.mark.parametrize(
    "body,param",
    [
        ('{"prompt": "hi", "max_tokens": 4', None),  # invalid JSON
        ('{"prompt": "hi", "max_tokens": "four"}', "max_tokens"),
        ('{"prompt": "", "max_tokens": 4}', "prompt"),
        ('{"prompt": "hi", "max_tokens": 100000}', "max_tokens"),
        ('{"prompt": "hi", "temperature": -1}', "temperature"),
        ('{"prompt": "hi", "top_p": 0}', "top_p"),
    ],
)
def test_bad_input_gets_a_4xx_and_the_server_answers_the_next_request(base_url, body, param):
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    bad = httpx.post(f"{base_url}/v1/completions", content=body, headers=headers)
    assert 400 <= bad.status_code < 500
    assert bad.json()["error"]["type"] == "invalid_request_error" and bad.json()["error"]["message"]
    if param:
        assert bad.json()["error"]["param"] == param
    good = httpx.post(f"{base_url}/v1/completions", json={"prompt": "hi", "max_tokens": 3}, headers=headers)
    assert good.status_code == 200 and good.json()["choices"][0]["text"] is not None


def test_api_key_health_and_metrics(base_url):
    assert httpx.post(f"{base_url}/v1/completions", json={"prompt": "hi"}).status_code == 401
    assert httpx.get(f"{base_url}/health").json() == {"status": "ok"}
    # long enough for a speculative step whatever adaptive K makes of this machine's step costs: plain
    # decoding probes with one draft every PROBE_EVERY steps
    done = client(base_url).completions.create(model="tiny", prompt="hello", max_tokens=PROBE_EVERY + 4, temperature=0)
    assert done.usage.completion_tokens > PROBE_EVERY
    metrics = httpx.get(f"{base_url}/metrics").text
    drafts = [float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("draftsmith:spec_decode_num_drafts_total")]
    assert drafts and drafts[0] > 0
    assert "draftsmith:spec_decode_num_accepted_tokens_per_pos_total" in metrics
    assert "draftsmith:e2e_request_latency_seconds_count" in metrics


def test_64_streaming_clients_for_a_minute_all_complete(base_url):
    # bench serve's own load generator: every request must end with [DONE] and its usage chunk
    row = asyncio.run(run_level(base_url, "tiny", heldout_messages()[:32], concurrency=64, max_tokens=24, duration=60.0, api_key=API_KEY))
    assert row["errors"] == 0, row["first_error"]
    assert row["requests"] >= 64 and row["output_tokens"] > 0
    assert httpx.get(f"{base_url}/ready").status_code == 200  # and it still serves
    metrics = httpx.get(f"{base_url}/metrics").text
    assert re.search(r"^draftsmith:num_requests_running 0\.0$", metrics, re.M)  # every row was freed


def test_alert_rules_and_dashboard_query_metrics_the_server_exports(base_url):
    from importlib import resources

    import yaml

    client(base_url).completions.create(model="tiny", prompt="hello", max_tokens=6, temperature=0)
    exported = set(re.findall(r"^(draftsmith:[a-z_:]+)", httpx.get(f"{base_url}/metrics").text, re.M))
    folder = resources.files("draftsmith.serve") / "monitoring"
    rules = yaml.safe_load((folder / "alerts.yml").read_text())["groups"][0]["rules"]
    dashboard = json.loads((folder / "grafana_dashboard.json").read_text())
    exprs = [r["expr"] for r in rules] + [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert any("0.55" in r["expr"] and r["for"] == "5m" for r in rules)  # the acceptance alert
    for expr in exprs:
        for name in re.findall(r"draftsmith:[a-z_:]+", expr):
            assert name in exported, f"{name} is queried but not exported"


def test_a_failed_warm_up_shows_on_health_and_ready_and_is_told(tiny_chat_target):
    # the H200 ran out of memory in a warm-up once and the server answered 503 "not ready" forever
    from transformers import AutoTokenizer

    def out_of_memory():
        raise RuntimeError("CUDA out of memory (injected)")

    engine = Engine(load_model(tiny_chat_target, torch.float32), max_batch_size=2, max_seq_len=64)
    server = Server(engine, AutoTokenizer.from_pretrained(tiny_chat_target), "tiny", num_speculative_tokens=0, max_model_len=60)
    server.scheduler.warm_up = out_of_memory
    told = threading.Event()
    server.on_failure = told.set

    async def probe() -> tuple[httpx.Response, httpx.Response]:
        transport = httpx.ASGITransport(app=create_app(server))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            return await http.get("/health"), await http.get("/ready")

    server.start()
    assert told.wait(10)
    health, ready = asyncio.run(probe())
    assert (health.status_code, health.json()["status"]) == (500, "failed")
    assert ready.status_code == 503 and "out of memory" in ready.json()["error"]


def test_stream_smoothing_sends_bursts_in_small_groups(tiny_chat_target):
    # the target as its own draft: every step keeps K + 1 = 4 tokens, one burst per step unsmoothed
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_chat_target)

    async def chunks(smooth: int) -> list[str]:
        model = load_model(tiny_chat_target, torch.float32)
        engine = Engine(model, load_model(tiny_chat_target, torch.float32), max_batch_size=2, max_seq_len=128)
        server = Server(engine, tokenizer, "tiny", num_speculative_tokens=3, max_model_len=100, adaptive_k=False, smooth_stream=smooth)
        server.start()
        while not server.ready:
            await asyncio.sleep(0.05)
        body = {"prompt": "Card declined abroad", "max_tokens": 40, "temperature": 0, "stream": True}
        pieces = []
        transport = httpx.ASGITransport(app=create_app(server))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            async with http.stream("POST", "/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        pieces.append(json.loads(line[6:])["choices"][0]["text"])
        server.stop()
        return [p for p in pieces if p]

    bursts, smooth = asyncio.run(chunks(0)), asyncio.run(chunks(1))
    assert "".join(bursts) == "".join(smooth)
    assert len(smooth) > 2 * len(bursts)


def test_a_stream_behind_the_engine_sends_the_waiting_steps_as_one_chunk(tiny_chat_target):
    # the event loop held up after the first chunk (as a busy server's is): the engine's later steps wait in the
    # reply's queue, and go out as one chunk, not one a step, with the same text
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_chat_target)

    async def chunks(hold: float) -> list[str]:
        model = load_model(tiny_chat_target, torch.float32)
        engine = Engine(model, load_model(tiny_chat_target, torch.float32), max_batch_size=2, max_seq_len=128)
        server = Server(engine, tokenizer, "tiny", num_speculative_tokens=3, max_model_len=100, adaptive_k=False)
        server.start()
        while not server.ready:
            await asyncio.sleep(0.05)
        loop, count_step = asyncio.get_running_loop(), server.scheduler.on_step

        def first_step_holds_the_loop(k: int, accepted: list[int]) -> None:  # on the engine's thread
            count_step(k, accepted)
            if server.scheduler.on_step is first_step_holds_the_loop:
                server.scheduler.on_step = count_step
                loop.call_soon_threadsafe(time.sleep, hold)  # the loop stalls; the engine's thread runs on

        server.scheduler.on_step = first_step_holds_the_loop
        body = {"prompt": "Card declined abroad", "max_tokens": 40, "temperature": 0, "ignore_eos": True, "stream": True}
        pieces = []
        transport = httpx.ASGITransport(app=create_app(server))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            async with http.stream("POST", "/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: {") and (text := json.loads(line[6:])["choices"][0]["text"]):
                        pieces.append(text)
        server.stop()
        return pieces

    steps, held = asyncio.run(chunks(0.0)), asyncio.run(chunks(2.0))
    assert "".join(held) == "".join(steps)
    assert len(steps) >= 8 and len(held) <= 3  # 40 tokens at 4 a step: ten steps, or the first and the rest


def test_openai_parameters_are_honoured_or_refused_by_name(base_url):
    import openai as openai_errors

    openai = client(base_url)
    short = openai.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_completion_tokens=3, temperature=0
    )
    assert short.usage.completion_tokens <= 3
    parts = openai.chat.completions.create(
        model="tiny",
        temperature=0,
        max_tokens=5,
        messages=[{"role": "developer", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
    )
    assert parts.choices[0].message.content is not None
    ids = httpx.post(
        f"{base_url}/v1/completions",
        headers={"Authorization": f"Bearer {API_KEY}"},
        json={"model": "tiny", "prompt": [[1, 5, 9]], "max_tokens": 3, "temperature": None},
    ).json()
    assert ids["usage"]["prompt_tokens"] == 3
    listed = openai.completions.create(model="tiny", prompt=["Balance inquiry:"], max_tokens=3, temperature=0)
    assert listed.choices[0].text is not None
    alone = [openai.completions.create(model="tiny", prompt=p, max_tokens=4, temperature=0) for p in ("Card", [1, 5, 9])]
    both = openai.completions.create(model="tiny", prompt=["Card", "Card"], max_tokens=4, temperature=0, n=2)
    assert [c.index for c in both.choices] == [0, 1, 2, 3] and {c.text for c in both.choices} == {alone[0].choices[0].text}
    assert both.usage.prompt_tokens == 2 * alone[0].usage.prompt_tokens
    ids = httpx.post(
        f"{base_url}/v1/completions",
        headers={"Authorization": f"Bearer {API_KEY}"},
        json={"model": "tiny", "prompt": [[1, 5, 9], [1, 5, 9, 14]], "max_tokens": 4, "temperature": 0},
    ).json()
    assert ids["choices"][0]["text"] == alone[1].choices[0].text and ids["usage"]["prompt_tokens"] == 7
    with pytest.raises(openai_errors.NotFoundError) as missing:
        openai.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
    assert missing.value.body["code"] == "model_not_found" and missing.value.body["param"] == "model"
    two = lambda: openai.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=12, n=2, temperature=1.0, seed=4, logprobs=True
    )
    first = two()
    assert [c.index for c in first.choices] == [0, 1] and first.choices[0].message.content != first.choices[1].message.content
    assert first.usage.completion_tokens == sum(len(c.logprobs.content) for c in first.choices)  # every choice counted
    assert [c.message.content for c in two().choices] == [c.message.content for c in first.choices]  # seed, seed + 1
    for extra, param in (
        (dict(n=65), "n"),
        (dict(top_logprobs=2), "top_logprobs"),
        (dict(logprobs=True, top_logprobs=21), "top_logprobs"),
        (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}]), "tools"),
    ):
        with pytest.raises(openai_errors.BadRequestError) as refused:
            openai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=3, **extra)
        assert refused.value.body["param"] == param
    best_of = httpx.post(
        f"{base_url}/v1/completions",
        headers={"Authorization": f"Bearer {API_KEY}"},
        json={"model": "tiny", "prompt": "Hi", "max_tokens": 3, "n": 2, "best_of": 3},
    ).json()
    assert best_of["error"]["param"] == "best_of"
    assert httpx.get(f"{base_url}/v1/models/tiny", headers={"Authorization": f"Bearer {API_KEY}"}).json()["id"] == "tiny"
    # no max_tokens: the rest of the context
    rest = openai.completions.create(model="tiny", prompt="Card declined", temperature=0)
    assert rest.usage.completion_tokens > 16 or rest.choices[0].finish_reason == "stop"


def test_echo_puts_the_prompt_before_the_completion_streamed_or_not(base_url):
    import openai as openai_errors

    openai = client(base_url)
    ask = lambda prompt, **kw: openai.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0, **kw)
    plain = ask("Card declined abroad").choices[0].text
    echoed = ask("Card declined abroad", echo=True)
    assert echoed.choices[0].text == "Card declined abroad" + plain
    assert echoed.usage.completion_tokens == ask("Card declined abroad").usage.completion_tokens
    streamed = "".join(c.choices[0].text for c in ask("Card declined abroad", echo=True, stream=True) if c.choices)
    assert streamed == echoed.choices[0].text
    ids = [1, 5, 9]
    from_ids = ask(ids, echo=True, n=2).choices
    assert [c.index for c in from_ids] == [0, 1] and from_ids[0].text == from_ids[1].text
    assert from_ids[0].text.endswith(ask(ids).choices[0].text) and len(from_ids[0].text) > len(ask(ids).choices[0].text)
    with pytest.raises(openai_errors.BadRequestError) as refused:
        ask("Card", echo=True, logprobs=1)
    assert refused.value.body["param"] == "echo"
    chat = httpx.post(
        f"{base_url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {API_KEY}"},
        json={"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "echo": True},
    )
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "echo"


def test_a_seed_repeats_the_text_and_top_k_1_and_min_p_1_are_greedy(base_url):
    openai = client(base_url)
    ask = lambda seed, max_tokens=24, **kw: (
        openai.completions.create(model="tiny", prompt="Balance inquiry:", temperature=1.0, max_tokens=max_tokens, seed=seed, **kw)
        .choices[0]
        .text
    )
    first = ask(11)
    assert ask(11) == first and ask(12) != first

    greedy = openai.completions.create(model="tiny", prompt="Balance inquiry:", max_tokens=12, temperature=0).choices[0].text
    assert ask(None, max_tokens=12, extra_body={"top_k": 1}) == greedy  # vLLM's extension, as its clients send it
    assert ask(None, max_tokens=12, extra_body={"min_p": 1.0}) == greedy  # only the likeliest token is left
    refused = httpx.post(
        f"{base_url}/v1/completions",
        headers={"Authorization": f"Bearer {API_KEY}"},
        json={"model": "tiny", "prompt": "Hi", "max_tokens": 3, "min_p": 1.5},
    )
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "min_p"


def test_logprobs_are_the_targets_own(base_url, tiny_chat_target):
    """Greedy, so every chosen token is its position's most likely one; the values are the target's own
    log-softmax at each position (checked against a plain forward over prompt + completion)."""
    from transformers import AutoModelForCausalLM

    openai = client(base_url)
    chat = openai.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Card declined?"}], max_tokens=8, temperature=0, logprobs=True, top_logprobs=3
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-5)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob >= entry.top_logprobs[2].logprob
    ids = [1, 5, 9, 14]
    done = httpx.post(
        f"{base_url}/v1/completions",
        headers={"Authorization": f"Bearer {API_KEY}"},
        json={"model": "tiny", "prompt": ids, "max_tokens": 6, "temperature": 0, "logprobs": 0},
    ).json()
    got = done["choices"][0]["logprobs"]
    assert got["top_logprobs"] is None and len(got["tokens"]) == len(got["token_logprobs"]) == done["usage"]["completion_tokens"]
    target = AutoModelForCausalLM.from_pretrained(tiny_chat_target, dtype=torch.float32)
    tokens = torch.tensor([ids])
    with torch.no_grad():
        greedy = target.generate(tokens, max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True)
    expected = [step[0].log_softmax(-1).max().item() for step in greedy.logits][: len(got["token_logprobs"])]
    assert got["token_logprobs"] == pytest.approx(expected, abs=1e-3)


def test_a_stream_of_several_choices_with_logprobs_equals_the_whole_answer(base_url):
    openai = client(base_url)
    ask = dict(
        model="tiny",
        messages=[{"role": "user", "content": "Why was my card declined?"}],
        max_tokens=10,
        temperature=0,
        n=2,
        logprobs=True,
        top_logprobs=2,
        stop=" the",
    )
    whole = openai.chat.completions.create(**ask)
    text, entries, usage = {0: "", 1: ""}, {0: [], 1: []}, None
    for chunk in openai.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            text[choice.index] += choice.delta.content or ""
            entries[choice.index] += choice.logprobs.content if choice.logprobs else []
    for choice in whole.choices:
        assert text[choice.index] == choice.message.content
        assert [(e.token, e.logprob) for e in entries[choice.index]] == [(e.token, e.logprob) for e in choice.logprobs.content]
        assert all(len(e.top_logprobs) == 2 for e in entries[choice.index])
    assert usage.completion_tokens == whole.usage.completion_tokens and usage.prompt_tokens == whole.usage.prompt_tokens


STOPS = [None, " ", ".", ["e", ","], "the card"]


def test_streamed_text_equals_the_whole_answer_for_every_stop_setting(base_url):
    openai = client(base_url)
    prompts = [m[0]["content"] for m in heldout_messages()[:20]]
    for stop in STOPS:
        for prompt in prompts:
            kwargs = dict(model="tiny", prompt=prompt, max_tokens=24, temperature=0, stop=stop)
            whole = openai.completions.create(**kwargs).choices[0].text
            streamed = "".join(c.choices[0].text for c in openai.completions.create(stream=True, **kwargs))
            assert streamed == whole, (stop, prompt)


def test_clients_that_disconnect_free_their_rows(base_url):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": "tiny", "prompt": "Tell me about wire transfers", "max_tokens": 150, "temperature": 0}

    def abandon():
        try:
            httpx.post(f"{base_url}/v1/completions", json=body, headers=headers, timeout=0.3)
        except httpx.TimeoutException:
            pass

    threads = [threading.Thread(target=abandon) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    running = lambda: float(re.search(r"^draftsmith:num_requests_running (\S+)$", httpx.get(f"{base_url}/metrics").text, re.M)[1])
    deadline = time.time() + 1.5
    while running() > 0 and time.time() < deadline:
        time.sleep(0.05)
    assert running() == 0  # every abandoned generation was cancelled within a second or so
    started = time.time()
    answer = httpx.post(f"{base_url}/v1/completions", json={**body, "max_tokens": 4}, headers=headers, timeout=30)
    assert answer.status_code == 200 and time.time() - started < 5


def test_bad_bodies_get_openai_errors(base_url):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    surrogate = httpx.post(
        f"{base_url}/v1/chat/completions",
        headers={**headers, "Content-Type": "application/json"},
        content=b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 3}',
    )
    assert surrogate.status_code == 400 and surrogate.json()["error"]["param"] == "messages.0.content"
    huge = httpx.post(f"{base_url}/v1/completions", headers=headers, json={"prompt": "x", "padding": "y" * (5 << 20)})
    assert huge.status_code == 413 and huge.json()["error"]["message"].startswith("the request body is larger")
    for response in (
        httpx.get(f"{base_url}/v1/nowhere", headers=headers),
        httpx.get(f"{base_url}/v1/completions", headers=headers),
        httpx.post(f"{base_url}/v1/completions", headers=headers, content=b"{not json"),
    ):
        assert 400 <= response.status_code < 500 and set(response.json()["error"]) == {"message", "type", "param", "code"}
        assert response.json()["error"]["param"] is None
    curl_style = httpx.post(
        f"{base_url}/v1/completions",
        content=b'{"prompt": "hi", "max_tokens": 2}',
        headers={**headers, "Content-Type": "application/x-www-form-urlencoded"},
    )  # what curl -d sends
    assert curl_style.status_code == 200


def test_incremental_detokenization_gives_the_whole_decode_in_any_bursts(tiny_chat_target):
    # a stream decodes each burst's tokens only; accents, CJK and emoji span several byte-level tokens,
    # so bursts end mid-character: the text grows by whole characters and ends as the whole decode
    import random

    from transformers import AutoTokenizer

    from draftsmith.serve.stops import IncrementalText

    tokenizer = AutoTokenizer.from_pretrained(tiny_chat_target)
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
    text = "Crème brûlée 🍮🎉 costs ¥1,200 — 東京の夜は静かです。  Tabs\tand\nnew lines; naïve café ✓✓"
    ids = tokenizer.encode(text)
    assert any("\ufffd" in decode(ids[:i]) for i in range(len(ids)))  # some prefixes do end mid-character
    draw = random.Random(0)
    for _ in range(20):
        choice, i = IncrementalText(decode), 0
        while i < len(ids):
            n = draw.randint(1, 4)
            choice.extend(ids[i : i + n])
            i += n
            assert decode(ids[:i]).startswith(choice.text) and "\ufffd" not in choice.text
        assert choice.text == decode(ids) == text
