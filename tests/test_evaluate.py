"""Evaluation: counters against hand-computed cases, the cost model and K choice on synthetic numbers,
and, end to end on a tiny chat target, a reproducible eval.json and gates that fail the job."""
import json
import os
import subprocess
import sys
from pathlib import Path

from types import SimpleNamespace

import pytest

from draftsmith.evaluate.stage import gates
from draftsmith.evaluate.cost import StepCosts, choose_k, expected_tokens, predicted_speedup
from draftsmith.serve.stats import SpecStats

DRAFTSMITH = str(Path(sys.executable).parent / "draftsmith")


def test_alpha_tau_and_positions_from_hand_computed_steps():
    stats = SpecStats()
    stats.record(3, [0, 3, 1])  # three rows: rejected at once, all kept, one kept
    assert stats.acceptance_rate == pytest.approx(4 / 9)
    assert stats.tau == pytest.approx((4 + 3) / 3)  # accepted plus one corrected/bonus token per step
    assert stats.acceptance_by_position == pytest.approx([2 / 3, 1 / 3, 1 / 3])
    stats.record(1, [1])
    assert stats.acceptance_rate == pytest.approx(5 / 10) and stats.tau == pytest.approx(9 / 4)
    assert stats.acceptance_by_position == pytest.approx([3 / 4, 1 / 3, 1 / 3])


def test_expected_tokens_and_predicted_speedup():
    assert expected_tokens(0.5, 3) == pytest.approx(1.875)
    assert expected_tokens(1.0, 4) == 5.0 and expected_tokens(0.0, 4) == 1.0
    costs = StepCosts(batch_size=1, target_ms=10.0, draft_ms=1.0, verify_ms={k: 10.0 + k for k in range(1, 9)})
    # K=2 at alpha 0.8: (1 - 0.8^3) / 0.2 = 2.44 tokens for 2 * 1 + 12 ms against 10 ms a token
    assert predicted_speedup(0.8, 2, costs) == pytest.approx(2.44 * 10 / 14)


def test_k_choice_prefers_measurements_and_says_why():
    costs = StepCosts(batch_size=1, target_ms=10.0, draft_ms=1.0, verify_ms={k: 10.0 + k for k in range(1, 9)})
    predicted = {k: predicted_speedup(0.8, k, costs) for k in range(1, 9)}
    best = max(predicted, key=predicted.get)
    assert best == 4  # rising expected length against linearly rising cost
    assert choose_k({}, predicted) == (4, f"K=4 has the best predicted speedup over plain decoding ({predicted[4]:.2f}x)")
    k, why = choose_k({1: 1.1, 2: 1.4, 3: 1.3}, predicted)
    assert k == 2 and "measured" in why
    k, why = choose_k({1: 0.9, 2: 0.8}, predicted)
    assert k == 1 and "slower than plain decoding" in why
    assert choose_k({1: 1.2, 2: 1.2}, {})[0] == 1  # a tie goes to the smaller K


def report(shipped: str, k: int, **taus_alphas) -> dict:
    rows = [{"proposer": name, "temperature": 0.0, "k": k, "alpha": alpha, "tau": tau}
            for name, (alpha, tau) in taus_alphas.items()]
    return {"shipped": shipped, "num_speculative_tokens": k, "acceptance": rows}


def test_gates_on_alpha_and_on_the_w4a16_tau_loss():
    thresholds = SimpleNamespace(min_alpha=0.55, max_tau_loss=0.03)
    quantized = report("w4a16", 2, w4a16=(0.625, 2.25), bf16=(0.75, 2.5))
    result = gates(thresholds, quantized)
    assert result["min_alpha"]["value"] == pytest.approx(0.625) and result["min_alpha"]["passed"]
    assert result["max_tau_loss"]["value"] == pytest.approx(0.1) and not result["max_tau_loss"]["passed"]
    assert not result["passed"]
    assert gates(SimpleNamespace(min_alpha=0.55, max_tau_loss=0.1), quantized)["passed"]
    only_bf16 = report("bf16", 2, bf16=(0.75, 2.5))
    passed = gates(SimpleNamespace(min_alpha=0.7, max_tau_loss=0.03), only_bf16)
    assert passed["passed"] and passed["max_tau_loss"]["value"] is None
    assert not gates(SimpleNamespace(min_alpha=0.8, max_tau_loss=0.03), only_bf16)["passed"]


def run(*args, cwd):
    return subprocess.run([DRAFTSMITH, "run", *args], cwd=cwd, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "COLUMNS": "200"})


def only_output(root: Path, stage: str) -> Path:
    outputs = [p for p in (root / stage).iterdir() if not p.name.startswith(".")]
    assert len(outputs) == 1, outputs
    return outputs[0]


@pytest.fixture(scope="module")
def evaluated(tiny_chat_target, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("eval")
    args = ("experiment=t", "target=hf", f"target.name_or_path={tiny_chat_target}", f"paths.root={tmp / 'runs'}",
            "tracking.enabled=false", "data.max_prompts=24", "data.eval_fraction=0.25", "distill.teacher.max_new_tokens=8",
            "distill.max_steps=4", "distill.eval_every=4", "draft.num_layers=1", "distill.batch_size=4",
            "quantize.num_calibration_samples=8", "evaluate.max_new_tokens=10", "evaluate.batch_size=3",
            "evaluate.min_alpha=0.0", "evaluate.max_tau_loss=1.0", "evaluate.max_speculative_tokens=5")
    done = run(*args, cwd=tmp)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return tmp, args, done


def test_eval_json_covers_every_proposer_k_and_temperature(evaluated):
    tmp, _, done = evaluated
    out = only_output(tmp / "runs", "evaluate")
    report = json.loads((out / "eval.json").read_text())
    assert report["shipped"] == "w4a16"
    assert set(report["proposers"]) == {"w4a16", "bf16", "initial", "prompt_lookup"}
    for name in report["proposers"]:
        for t in (0.0, 0.7):
            ks = sorted(r["k"] for r in report["acceptance"] if r["proposer"] == name and r["temperature"] == t)
            assert ks == [1, 2, 3, 4, 5], (name, t)
    for row in report["acceptance"]:
        if row["k"]:
            assert 0.0 <= row["alpha"] <= 1.0 and 1.0 <= row["tau"] <= row["k"] + 1
            assert row["tau"] == pytest.approx(1 + row["alpha"] * row["k"])  # tau = 1 + alpha K, by the counters' definitions
            assert len(row["acceptance_by_position"]) == row["k"]
    # lossless: at T = 0 every proposer emits the same tokens as plain decoding
    greedy_tokens = {r["tokens"] for r in report["acceptance"] if r["temperature"] == 0.0}
    assert len(greedy_tokens) == 1
    assert 1 <= report["num_speculative_tokens"] <= 5 and report["why"]
    for name in ("eval.md", "acceptance_by_position.png", "tau_vs_k.png", "speedup.png"):
        assert (out / name).stat().st_size > 0
    assert "tau_k5_initial" in done.stdout and "tau_k5_prompt_lookup" in done.stdout


def test_eval_json_is_reproducible(evaluated):
    tmp, args, _ = evaluated
    out = only_output(tmp / "runs", "evaluate")
    first = json.loads((out / "eval.json").read_text())
    out.rename(out.parent / ".moved-away")  # not an output any more: the stage runs again
    again = run(*args, cwd=tmp)
    assert again.returncode == 0, again.stderr[-3000:]
    second = json.loads((only_output(tmp / "runs", "evaluate") / "eval.json").read_text())
    assert first["acceptance"] == second["acceptance"]  # T = 0 and T = 0.7 with the same seed


def test_a_failed_gate_fails_the_job_and_an_override_lets_it_through(evaluated):
    tmp, args, _ = evaluated
    published = lambda: len([p for p in (tmp / "runs" / "publish").iterdir() if not p.name.startswith(".")])
    before = published()
    strict = [a for a in args if not a.startswith("evaluate.min_alpha")] + ["evaluate.min_alpha=0.999"]
    failed = run(*strict, cwd=tmp)
    assert failed.returncode == 1
    assert "evaluation gate failed: min_alpha" in failed.stdout and "publish.override_gates=true" in failed.stdout
    assert "│ evaluate │ cached" not in failed.stdout  # no summary: the job stopped at the gate
    assert published() == before  # the thresholds are the publish stage's: nothing new was published
    overridden = run(*strict, "publish.override_gates=true", cwd=tmp)
    assert overridden.returncode == 0, overridden.stdout[-2000:]
    assert published() == before + 1 and "gates_overridden=True" in overridden.stdout
