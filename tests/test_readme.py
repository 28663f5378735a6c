"""The README's serving examples run as written (the port and the path of the CLI aside) against a published
bundle: `draftsmith serve models:/draftsmith-draft@champion`, the curl command and the openai client."""

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

from tests.conftest import wait_ready
from tests.test_publish import published  # noqa: F401 - the tiny pipeline's published and registered bundle

README = Path(__file__).parents[1] / "README.md"
DRAFTSMITH = str(Path(sys.executable).parent / "draftsmith")


def example(name: str) -> str:
    """The code block after `<!-- example: NAME -->` in the README."""
    found = re.search(rf"<!-- example: {name} -->\n```\w+\n(.*?)```", README.read_text(), re.S)
    assert found, f"the README has no example {name!r}"
    return found.group(1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_serving_examples_run_as_written(published, tmp_path):  # noqa: F811
    tmp, _, _ = published
    port = str(free_port())
    on_port = lambda text: text.replace("8000", port)
    serve = on_port(example("serve")).strip().replace(".venv/bin/draftsmith", DRAFTSMITH)
    # the registry of the published fixture, where `make demo`'s would be runs/demo/mlflow.db
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp / 'runs' / 'mlflow.db'}", "COLUMNS": "200"}
    server = subprocess.Popen(
        serve.split() + ["--device", "cpu"], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        wait_ready(f"http://127.0.0.1:{port}", alive=lambda: server.poll() is None)
        curl = subprocess.run(["bash", "-c", on_port(example("curl"))], capture_output=True, text=True, timeout=120)
        assert curl.returncode == 0, curl.stderr
        reply = json.loads(curl.stdout)
        assert reply["choices"][0]["message"]["content"] and reply["usage"]["completion_tokens"] >= 1
        client = subprocess.run([sys.executable, "-c", on_port(example("openai"))], capture_output=True, text=True, timeout=120)
        assert client.returncode == 0 and client.stdout.strip(), client.stderr[-3000:]
    finally:
        server.terminate()
        server.wait(timeout=60)
