"""The HTTP server on CPU with a tiny chat target and draft: the official openai client completes and
streams, bad input gets a 4xx with an OpenAI-style body and the server keeps serving, metrics count."""
import socket
import threading
import time

import httpx
import pytest
import torch

from draftsmith.distill.draft import copy_tokenizer_files
from draftsmith.serve.engine import Engine
from draftsmith.serve.server import Server, create_app
from draftsmith.serve.weights import load_model
from tests.conftest import save_truncated_draft

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
    engine = Engine(load_model(tiny_chat_target, torch.float32), load_model(draft, torch.float32), max_seq_len=256,
                    eos_token_ids=frozenset({2}))
    server = Server(engine, AutoTokenizer.from_pretrained(tiny_chat_target), "tiny", num_speculative_tokens=3,
                    max_model_len=200)
    port = free_port()
    config = uvicorn.Config(create_app(server, api_key=API_KEY), host="127.0.0.1", port=port, log_level="warning")
    thread = threading.Thread(target=uvicorn.Server(config).run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            if httpx.get(f"{url}/ready").status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    else:
        pytest.fail("the server did not become ready")
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


@pytest.mark.parametrize("body,param", [
    ('{"prompt": "hi", "max_tokens": 4', None),  # invalid JSON
    ('{"prompt": "hi", "max_tokens": "four"}', "max_tokens"),
    ('{"prompt": "", "max_tokens": 4}', "prompt"),
    ('{"prompt": "hi", "max_tokens": 100000}', "max_tokens"),
    ('{"prompt": "hi", "temperature": -1}', "temperature"),
    ('{"prompt": "hi", "top_p": 0}', "top_p"),
])
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
    client(base_url).completions.create(model="tiny", prompt="hello", max_tokens=6, temperature=0)
    metrics = httpx.get(f"{base_url}/metrics").text
    drafts = [float(line.split()[-1]) for line in metrics.splitlines()
              if line.startswith("draftsmith:spec_decode_num_drafts_total")]
    assert drafts and drafts[0] > 0
    assert "draftsmith:spec_decode_num_accepted_tokens_per_pos_total" in metrics
    assert "draftsmith:e2e_request_latency_seconds_count" in metrics
