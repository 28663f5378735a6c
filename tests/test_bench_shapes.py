"""`draftsmith bench shapes` on a tiny shape on CPU: every row measured, and the projection is tau(K) x plain / step."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from draftsmith.serve.stats import expected_tokens

DRAFTSMITH = str(Path(sys.executable).parent / "draftsmith")


def test_a_tiny_shape_is_measured_and_projected(tmp_path):
    out = tmp_path / "shapes.json"
    done = subprocess.run(
        [
            DRAFTSMITH,
            "bench",
            "shapes",
            "--shape",
            "tiny",
            "--batch",
            "1",
            "--batch",
            "2",
            "--k",
            "2",
            "--k",
            "3",
            "--alpha",
            "0.7",
            "--new-tokens",
            "8",
            "--prompt-tokens",
            "6",
            "--repeats",
            "1",
            "--bandwidth",
            "50",
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = result["rows"]
    methods = {(r["method"], r["batch"], r["k"]) for r in rows}
    for b in (1, 2):
        assert ("plain", b, 0) in methods and {("verify 1 tokens", b, 0), ("verify 3 tokens", b, 2), ("verify 4 tokens", b, 3)} <= methods
        for k in (2, 3):
            assert ("draft model 2 layers", b, k) in methods and ("EAGLE-3 head", b, k) in methods
    plain = {r["batch"]: r["ms"] for r in rows if r["method"] == "plain"}
    for r in rows:
        assert r["ms"] > 0
        if r["method"] in ("draft model 2 layers", "EAGLE-3 head"):
            assert r["projected_speedup"] == pytest.approx(expected_tokens(0.7, r["k"]) * plain[r["batch"]] / r["ms"])
    assert result["bandwidth_floor_ms"]["tiny"] > 0 and result["bandwidth_gb_s"] == 50 and "floor / plain" in done.stdout


def test_the_floor_takes_the_devices_own_bandwidth():
    from draftsmith.evaluate.bench_shapes import datasheet_bandwidth

    assert datasheet_bandwidth("NVIDIA H200") == 4800
    assert datasheet_bandwidth("NVIDIA H100 80GB HBM3") == 3350  # SXM: a floor 1.4x the H200's
    assert datasheet_bandwidth("NVIDIA H100 PCIe") == 2000
    assert datasheet_bandwidth("NVIDIA L4") is None  # unknown: no floor rather than another GPU's


def test_an_unknown_shape_is_refused_with_the_list():
    done = subprocess.run([DRAFTSMITH, "bench", "shapes", "--shape", "gpt-5"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "unknown shape 'gpt-5'" in done.stderr and "llama-3.1-8b" in done.stderr
