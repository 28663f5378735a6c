"""The bundle end to end on a tiny chat target: published, verified, registered and promoted; verify
catching tampering; a crash mid-publish leaving nothing; promotion rules; a sweep picking its best."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from draftsmith.pipeline.bundle import BundleError, verify, write_manifest
from draftsmith.pipeline.registry import decide

DRAFTSMITH = str(Path(sys.executable).parent / "draftsmith")


def draftsmith(*args, cwd):
    return subprocess.run([DRAFTSMITH, *args], cwd=cwd, capture_output=True, text=True, timeout=900, env={**os.environ, "COLUMNS": "220"})


def pipeline_args(target: Path, root: Path) -> list[str]:
    return [
        "run",
        "experiment=t",
        "target=hf",
        f"target.name_or_path={target}",
        f"paths.root={root}",
        "data.max_prompts=24",
        "data.eval_fraction=0.25",
        "distill.teacher.max_new_tokens=8",
        "distill.max_steps=4",
        "distill.eval_every=4",
        "draft.num_layers=1",
        "distill.batch_size=4",
        "quantize.num_calibration_samples=8",
        "evaluate.max_new_tokens=10",
        "evaluate.batch_size=3",
        "evaluate.min_alpha=0.0",
        "evaluate.max_tau_loss=1.0",
        "evaluate.max_speculative_tokens=3",
        # a tiny random target's draft never pays on a CPU: the promotion rules are tested apart from speed
        "evaluate.min_speedup=0.0",
    ]


def registry_rows(root: Path) -> list[dict]:
    from draftsmith.pipeline.registry import list_versions

    return list_versions(f"sqlite:///{root / 'mlflow.db'}", "draftsmith-draft")


@pytest.fixture(scope="module")
def published(tiny_chat_target, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("publish")
    done = draftsmith(*pipeline_args(tiny_chat_target, tmp / "runs"), cwd=tmp)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    bundles = [p / "bundle" for p in (tmp / "runs" / "publish").iterdir() if not p.name.startswith(".")]
    assert len(bundles) == 1
    return tmp, bundles[0], done


def test_published_bundle_verifies_and_is_the_registered_champion(published):
    tmp, bundle, done = published
    assert draftsmith("bundle", "verify", str(bundle), cwd=tmp).returncode == 0
    spec = json.loads((bundle / "speculative_config.json").read_text())
    assert spec["method"] == "draft_model" and spec["model"] == "draft" and 1 <= spec["num_speculative_tokens"] <= 3
    assert json.loads((bundle / "draft" / "config.json").read_text())["quantization_config"]["quant_method"] == "compressed-tensors"
    for name in ("target.json", "serve.sh", "eval.json", "README.md", "manifest.json", "tau_vs_k.png", "eval_prompts.json"):
        assert (bundle / name).is_file(), name
    # what vLLM decodes in `make vllm-check`: the held-out prompts' token ids that eval.json measured
    prompts, report = (json.loads((bundle / name).read_text()) for name in ("eval_prompts.json", "eval.json"))
    assert len(prompts["prompt_token_ids"]) == report["eval_split"]["num_prompts"] > 0
    assert prompts["max_new_tokens"] == report["eval_split"]["max_new_tokens"]
    assert "vllm serve" in (bundle / "serve.sh").read_text() and "draftsmith serve" in (bundle / "serve.sh").read_text()
    import yaml  # the bundle's alert rules fire below 75% of the acceptance its evaluation measured at its K

    from draftsmith.evaluate.report import rows_of

    k = report["num_speculative_tokens"]
    measured = min(rows_of(report, report["shipped"], t)[k]["acceptance_rate"] for t in report["temperatures"])
    rules = {r["alert"]: r for r in yaml.safe_load((bundle / "alerts.yml").read_text())["groups"][0]["rules"]}
    assert rules["DraftsmithLowAcceptance"]["expr"].strip().endswith(f"< {round(0.75 * measured, 4):g}")
    rows = registry_rows(tmp / "runs")
    assert len(rows) == 1 and rows[0]["champion"] == "yes" and rows[0]["quantization"] == "W4A16 asymmetric"
    # the summary names the bundle, alpha, tau, K and the vllm command
    assert f"bundle: {bundle}" in done.stdout and "registry: draftsmith-draft version 1: champion" in done.stdout
    assert "--speculative-config" in done.stdout and f"{bundle}/draft" in done.stdout


def test_registered_model_loads_from_code_and_generates(published):
    import mlflow

    tmp, _, _ = published
    mlflow.set_tracking_uri(f"sqlite:///{tmp / 'runs' / 'mlflow.db'}")
    model = mlflow.pyfunc.load_model("models:/draftsmith-draft@champion")
    texts = model.predict(["How do I reset my card PIN?"], params={"max_tokens": 6})
    assert len(texts) == 1 and isinstance(texts[0], str)


@pytest.fixture
def bundle_copy(published, tmp_path):
    _, bundle, _ = published
    return Path(shutil.copytree(bundle, tmp_path / "bundle"))


def test_verify_catches_a_flipped_byte_in_the_draft_weights(bundle_copy):
    weights = bundle_copy / "draft" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01
    weights.write_bytes(bytes(data))
    with pytest.raises(BundleError, match=r"changed file: draft/model.safetensors"):
        verify(bundle_copy)


def test_verify_catches_a_removed_tokenizer_file(bundle_copy):
    (bundle_copy / "draft" / "tokenizer.json").unlink()
    with pytest.raises(BundleError, match=r"missing file: draft/tokenizer.json"):
        verify(bundle_copy)


def test_verify_catches_a_draft_with_another_vocab_size(bundle_copy):
    config = json.loads((bundle_copy / "draft" / "config.json").read_text())
    config["vocab_size"] = 49154
    (bundle_copy / "draft" / "config.json").write_text(json.dumps(config))
    write_manifest(bundle_copy)  # a bundle built wrong, not tampered with: only the vocab check can catch it
    with pytest.raises(BundleError, match=r"draft vocab size 49154 != target 49152"):
        verify(bundle_copy)


def test_verify_catches_k_zero(bundle_copy, published):
    spec = json.loads((bundle_copy / "speculative_config.json").read_text())
    (bundle_copy / "speculative_config.json").write_text(json.dumps({**spec, "num_speculative_tokens": 0}))
    write_manifest(bundle_copy)
    with pytest.raises(BundleError, match=r"num_speculative_tokens=0: vLLM needs a positive integer"):
        verify(bundle_copy)
    done = draftsmith("bundle", "verify", str(bundle_copy), cwd=published[0])
    assert done.returncode == 1 and "num_speculative_tokens=0" in done.stderr


def test_a_crash_mid_publish_leaves_no_bundle_and_no_registry_entry(tiny_chat_target, published, tmp_path):
    # run everything up to publish, then break the draft so that copying it fails half way through
    root = tmp_path / "runs"
    args = pipeline_args(tiny_chat_target, root)
    shutil.copytree(published[0] / "runs", root, ignore=shutil.ignore_patterns("publish", "registry", "mlflow.db", ".locks"))
    for p in (root / "quantize").glob("*/draft"):
        (p / "zz-dangling").symlink_to(p / "does-not-exist")
    crashed = draftsmith(*args, cwd=tmp_path)
    assert crashed.returncode == 1 and "stage 'publish' failed" in crashed.stdout
    assert [p for p in (root / "publish").iterdir()] == []  # no bundle and no half-written work dir
    assert registry_rows(root) == []


def test_promotion_needs_passed_gates_a_speedup_the_same_split_and_a_faster_version():
    champion = {"gates_passed": "true", "tau": "2.0", "k": "3", "eval_split": "a", "speedup": "1.3", "device": "cuda", "kind": "standalone"}
    head = {**champion, "kind": "eagle3", "tau": "2.9"}
    assert decide({**head, "speedup": "1.9"}, champion).promote  # either kind: the faster one
    assert "eagle3 1.9000x at K=3 beats the champion's (standalone) 1.3000x" in decide({**head, "speedup": "1.9"}, champion).reason
    assert not decide({**head, "speedup": "1.2"}, champion).promote  # a higher tau that runs slower loses
    assert "does not beat" in decide({**champion, "speedup": "1.3"}, champion).reason
    assert not decide({**champion, "speedup": "3.0", "gates_passed": "false"}, champion).promote
    assert "another held-out split or device" in decide({**champion, "speedup": "3.0", "eval_split": "b"}, champion).reason
    assert "another held-out split or device" in decide({**champion, "speedup": "3.0", "device": "cpu"}, champion).reason
    slower = decide({**champion, "speedup": "0.93"}, None)
    assert not slower.promote and "measured speedup 0.93x at K=3 on cuda is not above evaluate.min_speedup=1" in slower.reason
    assert decide({**champion, "speedup": "0.93"}, None, min_speedup=0.9).promote
    assert decide(champion, None).promote
    older = {k: v for k, v in champion.items() if k != "speedup"}  # registered before speeds were measured: tau decides
    assert decide({**champion, "tau": "2.5"}, older).promote and not decide({**champion, "tau": "1.5"}, older).promote


def test_a_bundle_measured_no_faster_than_plain_is_registered_but_not_champion(published, tmp_path):
    tmp, _, _ = published
    root = tmp_path / "runs"
    shutil.copytree(tmp / "runs", root, ignore=shutil.ignore_patterns(".locks"))
    args = [a for a in pipeline_args(Path("unused"), root) if not a.startswith("evaluate.min_speedup")]
    args = [
        f"target.name_or_path={json.loads(next((root / 'target').glob('*/target.json')).read_text())['name_or_path']}"
        if a.startswith("target.name_or_path")
        else a
        for a in args
    ]
    done = draftsmith(*args, "evaluate.min_speedup=100", cwd=tmp_path)  # only the registry stage runs again
    assert done.returncode == 0, done.stdout[-3000:]
    assert "version 2: registered, not promoted" in done.stdout and "is not above evaluate.min_speedup=100" in done.stdout
    assert [r["champion"] for r in registry_rows(root)] == ["yes", ""]


def test_a_sweep_registers_each_job_and_the_best_becomes_champion(tiny_chat_target, published, tmp_path):
    root = tmp_path / "runs"
    shutil.copytree(
        published[0] / "runs",
        root,
        ignore=shutil.ignore_patterns("distill", "quantize", "evaluate", "publish", "registry", "mlflow.db", ".locks"),
    )
    args = [a for a in pipeline_args(tiny_chat_target, root) if not a.startswith("distill.max_steps")]
    sweep = draftsmith("run", "-m", *args[1:], "distill.max_steps=1,6", cwd=tmp_path)
    assert sweep.returncode == 0, sweep.stdout[-3000:] + sweep.stderr[-3000:]
    rows = registry_rows(root)
    assert len(rows) == 2
    champion = [r for r in rows if r["champion"] == "yes"]
    assert len(champion) == 1 and float(champion[0]["speedup"]) == max(float(r["speedup"]) for r in rows)
    # rollback and promote move the alias; rollback needs something to roll back to
    from draftsmith.pipeline.registry import RegistryError, promote, rollback

    uri = f"sqlite:///{root / 'mlflow.db'}"
    other = next(r["version"] for r in rows if r["champion"] != "yes")
    promote(uri, "draftsmith-draft", other)
    assert rollback(uri, "draftsmith-draft") == champion[0]["version"]
    with pytest.raises(RegistryError, match="no version 99"):
        promote(uri, "draftsmith-draft", "99")
    listed = draftsmith("registry", "list", "--uri", uri, cwd=tmp_path)
    assert listed.returncode == 0 and listed.stdout.count("yes") == 1


def test_serve_loads_a_bundle_path_or_the_registered_champion(published):
    from draftsmith.pipeline.serving import BundleSourceError, load_server, resolve_bundle
    from draftsmith.serve.sampling import SamplingParams
    from draftsmith.serve.scheduler import Request

    tmp, bundle, _ = published
    from_registry = resolve_bundle("models:/draftsmith-draft@champion", f"sqlite:///{tmp / 'runs' / 'mlflow.db'}")
    assert verify(from_registry) == verify(bundle)
    server = load_server(from_registry, device="cpu", dtype="bfloat16", max_model_len=128, engine_process=False)
    assert server.k == json.loads((bundle / "speculative_config.json").read_text())["num_speculative_tokens"]
    assert server.scheduler.engine.draft is not None
    done = []
    server.scheduler.submit(Request(server.tokenizer.encode("hello"), SamplingParams(max_new_tokens=3), on_done=done.append))
    server.scheduler.drain()  # what the server's engine thread runs
    assert len(done) == 1 and 1 <= len(done[0].tokens) <= 3
    # --lookup-first: a row that repeats itself takes prompt lookup's drafts, and its greedy text stays the same
    prompt, params = server.tokenizer.encode("refund refund refund refund refund"), SamplingParams(max_new_tokens=24, ignore_eos=True)
    texts = []
    for lookup_first in (0, 2):
        server = load_server(bundle, device="cpu", dtype="float32", max_model_len=128, engine_process=False, lookup_first=lookup_first)
        texts.append(server.scheduler.run_all([prompt], params)[0][0].tokens)
    assert server.scheduler.proposer.min_match == 2 and texts[0] == texts[1]
    with pytest.raises(BundleSourceError, match="no such bundle dir"):
        resolve_bundle(str(tmp / "nowhere"))
    broken = shutil.copytree(bundle, tmp / "broken-bundle")
    (broken / "draft" / "tokenizer.json").unlink()
    with pytest.raises(BundleError, match="missing file"):
        load_server(broken, device="cpu", dtype="bfloat16", max_model_len=128)


def test_serve_steps_its_engine_in_a_process_of_its_own_with_the_same_replies(published, monkeypatch):
    # the HTTP server's work and the engine's no longer share an interpreter lock (issue 37): the engine steps
    # in a process of its own; clients get what the engine in the server's own process gives, limits are
    # checked at once, a client that goes away frees its row there, and an engine process that dies is told
    import asyncio
    import signal
    import time

    import httpx

    from draftsmith.pipeline.serving import load_server
    from draftsmith.serve import engine_process
    from draftsmith.serve.sampling import SamplingParams
    from draftsmith.serve.server import create_app

    _, bundle, _ = published
    body = {"prompt": "Card declined abroad", "max_tokens": 20, "temperature": 0, "ignore_eos": True, "logprobs": 2, "n": 2}

    async def replies(server) -> tuple[dict, str, httpx.Response]:
        server.start()
        while not server.ready:
            assert server.failed is None, server.failed
            await asyncio.sleep(0.05)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(server)), base_url="http://test") as http:
            whole = (await http.post("/v1/completions", json=body)).json()
            streamed = ""
            async with http.stream("POST", "/v1/completions", json={**body, "n": 1, "stream": True}) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        streamed += json.loads(line[6:])["choices"][0]["text"]
            too_long = await http.post("/v1/completions", json={"prompt": [5] * 60, "max_tokens": 20})
        return whole, streamed, too_long

    here = load_server(bundle, device="cpu", dtype="float32", max_model_len=64, engine_process=False)
    expected = asyncio.run(replies(here))
    here.stop()
    server = load_server(bundle, device="cpu", dtype="float32", max_model_len=64)
    assert server.scheduler.pid != os.getpid()

    async def walk_away_then_kill() -> tuple[list[int], httpx.Response, httpx.Response]:
        app = create_app(server)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
            async with http.stream(
                "POST", "/v1/completions", json={"prompt": "Hello", "max_tokens": 40, "ignore_eos": True, "stream": True}
            ) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        break  # the client goes away after its first chunk
            running = []
            for _ in range(40):
                running.append(server.scheduler.num_running)
                if running[-1] == 0:
                    break
                await asyncio.sleep(0.05)
            os.kill(server.scheduler.pid, signal.SIGKILL)
            for _ in range(100):
                if server.failed is not None:
                    break
                await asyncio.sleep(0.05)
            return running, await http.get("/health"), await http.get("/ready")

    async def by_the_thread() -> tuple[dict, list[int]]:
        # every request through the requests' thread, and a cancellation right behind its submission: it reaches
        # the engine's process after it (else that row would run to max_tokens for nobody)
        monkeypatch.setattr(engine_process, "DIRECT_IDS", 0)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(server)), base_url="http://test") as http:
            whole = (await http.post("/v1/completions", json=body)).json()
        steps = []
        monkeypatch.setattr(server.scheduler, "on_step", lambda k, accepted: steps.append(k))
        server.submit([5] * 8, SamplingParams(max_new_tokens=50, ignore_eos=True), asyncio.Queue()).cancelled.set()
        for _ in range(60):
            await asyncio.sleep(0.05)
        monkeypatch.undo()
        return whole, [len(steps), server.scheduler.num_running + server.scheduler.num_waiting]

    async def on_one_loop():  # the loop that started the server reads its engine's messages
        return await replies(server), await by_the_thread(), time.perf_counter(), await walk_away_then_kill()

    (whole, streamed, too_long), (threaded, rows), started, (running, health, ready) = asyncio.run(on_one_loop())
    assert [c["text"] for c in threaded["choices"]] == [c["text"] for c in whole["choices"]]
    assert rows[0] < 10 and rows[1] == 0  # the cancelled row was freed at once, not after its 50 tokens (25+ steps)
    assert [c["text"] for c in whole["choices"]] == [c["text"] for c in expected[0]["choices"]] and whole["usage"] == expected[0]["usage"]
    for got, want in zip(whole["choices"], expected[0]["choices"]):
        assert got["logprobs"]["tokens"] == want["logprobs"]["tokens"]
        assert got["logprobs"]["token_logprobs"] == pytest.approx(want["logprobs"]["token_logprobs"], abs=1e-4)
    assert streamed == expected[1] == whole["choices"][0]["text"]
    assert too_long.status_code == expected[2].status_code == 400 and too_long.json() == expected[2].json()

    assert running[-1] == 0 and time.perf_counter() - started < 10
    assert health.status_code == 500 and "engine's process exited" in health.json()["error"] and ready.status_code == 503
    server.stop()


def test_bench_serve_compares_the_server_with_its_own_engine(published):
    tmp, bundle, _ = published
    out = tmp / "compare.json"
    done = draftsmith(
        "bench",
        "serve",
        "--compare-engine",
        str(bundle),
        "--device",
        "cpu",
        "--concurrency",
        "1",
        "--concurrency",
        "3",
        "--duration",
        "1",
        "--max-tokens",
        "8",
        "--repeats",
        "2",
        "--out",
        str(out),
        cwd=tmp,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [(r["repeat"], r["concurrency"]) for r in rows] == [(1, 1), (1, 3), (2, 1), (2, 3)]
    assert all(r["errors"] == 0 and r["requests"] >= 1 for r in rows)
    for r in rows:  # each level's engine run in this process right after its server run
        assert r["engine_requests"] >= r["concurrency"] and r["engine_tokens_per_s"] > 0
        assert r["server_over_engine"] == round(r["tokens_per_s"] / r["engine_tokens_per_s"], 3)
        # where the time went: the engine process's stepping thread and this process's computed; a thread is on one CPU at most
        assert 0 < r["engine_busy"] <= 1.05 and 0 < r["engine_busy_alone"] <= 1.05 and 0 <= r["http_busy"] <= 1.05
    for level in result["medians"]:
        ratios = sorted(r["server_over_engine"] for r in rows if r["concurrency"] == level["concurrency"])
        assert level["runs"] == 2 and (level["ratio_low"], level["ratio_high"]) == (ratios[0], ratios[-1])
        assert level["server_over_engine"] == round((ratios[0] + ratios[1]) / 2, 3)
    assert "server_over_engine" in done.stdout and "medians over 2 run(s)" in done.stdout


# -- a bundle that travels, and verify as a gate -----------------------------------------------------


def moved_target(published, tmp_path) -> tuple[Path, Path]:
    """A copy of the bundle whose recorded target path no longer exists, and a copy of the target elsewhere."""
    _, bundle, _ = published
    copy = Path(shutil.copytree(bundle, tmp_path / "elsewhere" / "bundle"))
    reference = json.loads((copy / "target.json").read_text())
    target = Path(shutil.copytree(reference["path"], tmp_path / "models" / "target"))
    (copy / "target.json").write_text(json.dumps({**reference, "path": str(tmp_path / "was-here")}, indent=2))
    write_manifest(copy)
    return copy, target


def test_a_copied_bundle_verifies_and_serves_with_the_target_given_elsewhere(published, tmp_path):
    from draftsmith.pipeline.serving import load_server

    bundle, target = moved_target(published, tmp_path)
    with pytest.raises(BundleError, match="is not a model dir .*pass the target with --target PATH_OR_HUB_ID"):
        verify(bundle)
    assert verify(bundle, target)["method"] == "draft_model"
    done = draftsmith("bundle", "verify", str(bundle), "--target", str(target), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    server = load_server(bundle, device="cpu", dtype="float32", max_model_len=64, target=str(target), engine_process=False)
    assert server.scheduler.engine.draft is not None
    assert str(target) not in (bundle / "eval.json").read_text() and "/runs/" not in (bundle / "eval.json").read_text()
    assert 'TARGET="${TARGET:-' in (bundle / "serve.sh").read_text()
    weights = next(target.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01
    weights.write_bytes(bytes(data))
    with pytest.raises(BundleError, match=f"target file {weights.name} differs from the target the bundle was made for"):
        verify(bundle, target)
    assert verify(bundle, target, quick=True)  # --quick hashes no weights
    refused = draftsmith("serve", str(bundle), "--target", str(target), "--device", "cpu", cwd=tmp_path)
    assert refused.returncode == 1 and weights.name in refused.stderr and "Traceback" not in refused.stderr


def tampered(bundle: Path, how: str) -> None:
    draft = bundle / "draft"
    weights = draft / "model.safetensors"
    if how == "manifest JSON":
        (bundle / "manifest.json").write_text('{"format_version": 1, "files": {')
        return
    if how == "manifest without files":
        (bundle / "manifest.json").write_text('{"format_version": 1}')
        return
    if how == "speculative_config JSON":
        (bundle / "speculative_config.json").write_text("{'method': draft_model}")
    elif how == "draft config JSON":
        (draft / "config.json").write_text('{"vocab_size": 49152,')
    elif how == "truncated weights":
        weights.write_bytes(weights.read_bytes()[:-1000])
    elif how == "corrupted header":
        data = bytearray(weights.read_bytes())
        data[10:14] = b"\xff\xfe\x00{"
        weights.write_bytes(bytes(data))
    elif how == "layers":
        config = json.loads((draft / "config.json").read_text())
        (draft / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 5}))
    elif how == "K=1000":
        spec = json.loads((bundle / "speculative_config.json").read_text())
        (bundle / "speculative_config.json").write_text(json.dumps({**spec, "num_speculative_tokens": 1000}))
    elif how == "bare ignore":  # what llm-compressor writes, and vLLM cannot load
        config = json.loads((draft / "config.json").read_text())
        config["quantization_config"]["ignore"] = ["lm_head", "model.layers.0.mlp.down_proj"]
        (draft / "config.json").write_text(json.dumps(config))
    elif how == "symlinked weights":
        real = bundle.parent / "elsewhere.safetensors"
        weights.rename(real)
        weights.symlink_to(real)
    write_manifest(bundle)  # built wrong, not tampered with afterwards: only the content checks can catch it


@pytest.mark.parametrize(
    "how,reason",
    [
        ("manifest JSON", "manifest.json is not valid JSON"),
        ("manifest without files", 'manifest.json has no "files" table'),
        ("speculative_config JSON", "speculative_config.json is not valid JSON"),
        ("draft config JSON", "draft/config.json is not valid JSON"),
        ("truncated weights", "draft/model.safetensors is truncated"),
        ("corrupted header", "draft/model.safetensors is not readable: its safetensors header is not valid JSON"),
        ("layers", "draft tensor model.layers.1.input_layernorm.weight is missing (config.json has 5 layers)"),
        ("K=1000", "num_speculative_tokens=1000: at most 16"),
        ("symlinked weights", "draft/model.safetensors is a symbolic link"),
        ("bare ignore", "quantization_config.ignore names 1 layer(s) bare ('model.layers.0.mlp.down_proj')"),
    ],
)
def test_verify_refuses_a_broken_bundle_with_a_one_line_reason(bundle_copy, how, reason):
    tampered(bundle_copy, how)
    with pytest.raises(BundleError, match=re.escape(reason)):
        verify(bundle_copy)


def test_bundle_verify_lists_problems_without_a_traceback(bundle_copy, published):
    tampered(bundle_copy, "draft config JSON")
    done = draftsmith("bundle", "verify", str(bundle_copy), cwd=published[0])
    assert done.returncode == 1 and "draft/config.json is not valid JSON" in done.stderr and "Traceback" not in done.stderr


def test_a_wrong_registry_is_one_line(published, tmp_path):
    tmp, _, _ = published
    missing = draftsmith(
        "serve",
        "models:/draftsmith-draft@champion",
        "--tracking-uri",
        f"sqlite:///{tmp_path / 'other.db'}",
        "--device",
        "cpu",
        cwd=tmp_path,
    )
    assert missing.returncode == 1 and "there is no MLflow store at" in missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1, missing.stderr
    unknown = draftsmith(
        "serve",
        "models:/no-such-model@champion",
        "--tracking-uri",
        f"sqlite:///{tmp / 'runs' / 'mlflow.db'}",
        "--device",
        "cpu",
        cwd=tmp_path,
    )
    assert unknown.returncode == 1 and "could not be read from the registry" in unknown.stderr and "Traceback" not in unknown.stderr


def test_mlflow_records_plain_params_source_tags_artifacts_under_the_run_root_and_a_signature(published):
    from mlflow.models import get_model_info
    from mlflow.tracking import MlflowClient

    tmp, _, _ = published
    root = tmp / "runs"
    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}", registry_uri=f"sqlite:///{root / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("t")
    assert experiment.artifact_location.startswith(root.as_uri())
    job = next(r for r in client.search_runs([experiment.experiment_id]) if r.data.tags.get("draftsmith.kind") == "job")
    assert job.data.params["distill.loss"] == "forward_kl" and job.data.params["draft.kind"] == "standalone"
    assert len(job.data.tags["mlflow.source.git.commit"]) == 40 and job.data.tags["mlflow.user"]
    logged = {a.path for a in client.list_artifacts(job.info.run_id, "publish/bundle")}
    assert {"publish/bundle/README.md", "publish/bundle/eval.json"} <= logged
    assert "teacher/stage.json" in {a.path for a in client.list_artifacts(job.info.run_id, "teacher")}
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{root / 'mlflow.db'}")
    mlflow.set_registry_uri(f"sqlite:///{root / 'mlflow.db'}")
    info = get_model_info("models:/draftsmith-draft/1")
    assert info.signature is not None and [p.name for p in info.signature.params] == ["max_tokens", "temperature", "seed"]


@pytest.fixture(scope="module")
def published_head(tiny_chat_target, tmp_path_factory):
    """The pipeline with draft=eagle3 up to publish: a bundle whose draft is an EAGLE-3 head."""
    tmp = tmp_path_factory.mktemp("publish_head")
    done = draftsmith(
        *pipeline_args(tiny_chat_target, tmp / "runs"),
        "draft=eagle3",
        "draft.vocab_size=512",
        "tracking.enabled=false",
        "stop_after=publish",
        cwd=tmp,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    bundles = [p / "bundle" for p in (tmp / "runs" / "publish").iterdir() if not p.name.startswith(".")]
    assert len(bundles) == 1
    return tmp, bundles[0]


def test_an_eagle3_bundle_is_in_the_speculators_format_verifies_and_a_misfit_head_is_refused(published_head, tmp_path):
    tmp, bundle = published_head
    spec = verify(bundle)
    assert spec["method"] == "eagle3" and spec["model"] == "draft"
    head = json.loads((bundle / "draft" / "config.json").read_text())
    assert head["speculators_model_type"] == "eagle3" and head["architectures"] == ["Eagle3Speculator"]
    assert head["speculators_config"]["verifier"]["architectures"] and head["speculators_config"]["verifier"]["name_or_path"]
    assert len(head["eagle_aux_hidden_state_layer_ids"]) == 3 and head["transformer_layer_config"]["num_hidden_layers"] == 1
    assert head["draft_vocab_size"] == 512
    assert head["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == spec["num_speculative_tokens"]
    assert "--speculative-config" in (bundle / "serve.sh").read_text() and '"eagle3"' in (bundle / "serve.sh").read_text()
    assert "AWQ" in (bundle / "README.md").read_text()  # the card says the head is not quantized
    assert draftsmith("bundle", "verify", str(bundle), cwd=tmp).returncode == 0

    misfit = tmp_path / "misfit"
    shutil.copytree(bundle, misfit)
    config = misfit / "draft" / "config.json"
    config.write_text(json.dumps({**head, "target_hidden_size": head["target_hidden_size"] + 32}))
    write_manifest(misfit)  # made wrong, not tampered with: the head's shape check must catch it
    hidden = head["target_hidden_size"]  # the fused hidden states' projection no longer fits: vLLM's loader refuses it too
    with pytest.raises(BundleError, match=re.escape(f"fc.weight ({hidden}, {3 * hidden}) != ({hidden}, {3 * (hidden + 32)})")):
        verify(misfit)

    flipped = tmp_path / "flipped"
    shutil.copytree(bundle, flipped)
    weights = flipped / "draft" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(BundleError, match="draft/model.safetensors"):
        verify(flipped)


def test_registry_commands_find_the_store_as_run_does_and_create_nothing(published, tmp_path):
    tmp, _, _ = published
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    missing = draftsmith("registry", "list", cwd=elsewhere)
    assert missing.returncode == 1 and "no registry at" in missing.stderr and "Traceback" not in missing.stderr
    assert str(elsewhere / "runs" / "demo" / "mlflow.db") in missing.stderr  # where it looked: the config's paths.root
    assert not any(elsewhere.iterdir())  # and it created nothing there
    found = draftsmith("registry", "list", f"paths.root={tmp / 'runs'}", cwd=elsewhere)
    assert found.returncode == 0 and "draftsmith-draft" in found.stdout and "champion" in found.stdout, found.stderr
    wrong = draftsmith("registry", "list", "tracking.nope=1", cwd=elsewhere)
    assert wrong.returncode == 2 and "configuration error" in wrong.stderr


@pytest.mark.parametrize(
    "family,draft",
    [("gemma2", "from_target"), ("phi3", "from_target"), ("qwen3", "eagle3"), ("granite", "from_target"), ("granite", "eagle3")],
)
def test_the_pipeline_publishes_a_verified_bundle_for_each_family(family, draft, demo_target_dir, tmp_path):
    # the stages run every family in the runtime's own code: teacher, distillation, AWQ (each family's smoothing
    # pairs), evaluation and publish, whose bundle check derives the draft's tensors from its own config; a family
    # the runtime does not implement (Granite) runs through transformers (target.fallback), and serve refuses it
    from draftsmith.distill.tokenizer import copy_tokenizer_files
    from tests.conftest import save_tiny_model

    target = save_tiny_model(tmp_path / "target", family, seed=6, vocab_size=49152)
    copy_tokenizer_files(demo_target_dir, target)
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}))
    args = [a for a in pipeline_args(target, tmp_path / "runs") if not a.startswith("evaluate.max_speculative_tokens")]
    on_policy = ["distill.on_policy_fraction=0.5"] if family == "granite" and draft == "from_target" else []  # sampled in transformers
    done = draftsmith(
        *args,
        f"draft={draft}",
        "draft.vocab_size=512",
        "evaluate.max_speculative_tokens=2",
        "tracking.enabled=false",
        *on_policy,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    bundle = next((tmp_path / "runs" / "publish").glob("*/bundle"))
    spec = verify(bundle)
    assert spec["method"] == ("eagle3" if draft == "eagle3" else "draft_model")
    if draft == "from_target":
        draft_config = json.loads((bundle / "draft" / "config.json").read_text())
        assert draft_config["model_type"] == config["model_type"] and draft_config["quantization_config"]["format"] == "pack-quantized"
    assert json.loads((bundle / "target.json").read_text())["runtime"] == ("transformers" if family == "granite" else "draftsmith")
    if family == "granite":
        assert "through transformers" in done.stdout + done.stderr  # it says so
        refused = draftsmith("serve", str(bundle), "--device", "cpu", cwd=tmp_path)
        assert refused.returncode == 1 and "model_type 'granite' is not supported" in refused.stderr and "Traceback" not in refused.stderr


def test_a_bundle_written_before_the_glossary_rename_still_verifies_and_serves(bundle_copy):
    from draftsmith.pipeline.serving import load_server

    report = json.loads((bundle_copy / "eval.json").read_text())
    old = lambda row: {("alpha" if key == "acceptance_rate" else key): value for key, value in row.items()}
    report = {
        **report,
        "format_version": 2,
        "acceptance": [old(r) for r in report["acceptance"]],
        "engine": [old(r) for r in report["engine"]],
    }
    (bundle_copy / "eval.json").write_text(json.dumps(report))
    (bundle_copy / "eval_prompts.json").unlink()  # not shipped before
    write_manifest(bundle_copy)
    assert verify(bundle_copy)["num_speculative_tokens"] >= 1
    server = load_server(bundle_copy, device="cpu", dtype="float32", max_model_len=64, engine_process=False)
    assert server.k >= 1
