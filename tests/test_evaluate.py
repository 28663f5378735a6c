"""Evaluation: counters against hand-computed cases, the cost model and K choice on synthetic numbers,
and, end to end on a tiny chat target, a reproducible eval.json and gates that fail the job."""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from draftsmith.evaluate import report as reports
from draftsmith.evaluate.cost import choose_k, faster_than_plain, faster_than_shipped, predicted_speedup, predicted_speedups
from draftsmith.evaluate.stage import gates
from draftsmith.serve.stats import SpecStats, expected_tokens

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
    # 2.44 tokens per step of 14 ms against one token per plain step of 10 ms
    assert predicted_speedup(2.44, 10.0, 14.0) == pytest.approx(2.44 * 10 / 14)


def test_steps_timed_faster_than_a_plain_step_are_named():
    # a speculative step runs the target over K + 1 tokens: well under a plain step's time, it was disturbed
    # (on one H200 a W4A16 draft timed while another job trained: K=3 4.9 ms and K=8 4.9 ms, plain 6.0 ms)
    assert faster_than_plain({0: 6.02, 1: 5.17, 2: 6.49, 3: 5.08, 8: 4.88}) == [1, 3, 8]
    assert faster_than_plain({0: 2.93, 1: 3.32, 2: 3.48, 8: 4.64}) == []
    assert faster_than_plain({0: 10.0, 1: 9.5}) == []  # within the timing's own noise
    assert predicted_speedups({1: 1.7, 2: 2.2}, {0: 10.0, 1: 12.5, 2: 16.0}) == pytest.approx({1: 1.36, 2: 1.375})


def test_step_times_are_taken_in_turns_and_a_busy_moment_moves_none(tiny_models, monkeypatch):
    """Engine.time_steps times K = 0..max in turns and keeps each K's fastest: a job that takes the machine
    during two of a K's three steps (300 ms each) does not make that K look slower (a median would)."""
    import time

    from draftsmith.serve.engine import Engine
    from draftsmith.serve.weights import load_model

    target_dir, draft_dir = tiny_models["qwen2"]
    engine = Engine(load_model(target_dir, torch.float32), load_model(draft_dir, torch.float32), max_batch_size=2, max_seq_len=64)
    step, ks = engine.step, []

    def busy_twice(state, active, k, *rest):
        ks.append(k)
        if len(ks) in (3 * 1 + 2, 3 * 2 + 2):  # the first and second timed rounds' steps at K=1
            time.sleep(0.3)
        return step(state, active, k, *rest)

    monkeypatch.setattr(engine, "step", busy_twice)
    ms = engine.time_steps(2, range(3), rounds=3)
    assert ks == [0, 1, 2] * 4  # a warm-up round, then three timed rounds
    assert set(ms) == {0, 1, 2} and all(0 < v < 300 for v in ms.values())


def test_a_proposer_that_reads_the_text_is_timed_searching_texts_as_long_as_decoding_makes(tiny_models):
    """Lookup first's cost is partly the host's search of each row's text: timed on one-token texts it cost
    nothing, and adaptive K kept speculating where it decoded at half plain speed."""
    from draftsmith.serve.engine import Engine
    from draftsmith.serve.proposers import LookupFirst
    from draftsmith.serve.weights import load_model

    target_dir, draft_dir = tiny_models["qwen2"]
    engine = Engine(load_model(target_dir, torch.float32), load_model(draft_dir, torch.float32), max_batch_size=3, max_seq_len=96)
    searched = []

    class Recorded(LookupFirst):  # lookup first itself, noting how long each text it searched was
        def propose(self, state, k, rows, generator, histories=()):
            searched.append([len(h) for h in histories])
            return super().propose(state, k, rows, generator, histories)

    ms = engine.time_steps(3, range(3), rounds=2, proposer=Recorded(engine.draft_proposer, engine.target.args.vocab_size))
    assert set(ms) == {0, 1, 2} and searched == [[48, 48, 48]] * 6  # K = 1 and 2, a warm-up and two rounds


def test_k_choice_takes_the_best_speedup_and_says_why():
    k, why = choose_k({1: 1.1, 2: 1.4, 3: 1.3})
    assert k == 2 and why == "K=2 has the best predicted speedup over plain decoding (1.40x)"
    k, why = choose_k({1: 0.9, 2: 0.8}, "measured")
    assert k == 1 and "measured" in why and "slower than plain decoding" in why
    assert choose_k({1: 1.2, 2: 1.2})[0] == 1  # a tie goes to the smaller K


def test_replay_counts_steps_as_the_engine_does():
    import numpy as np

    from draftsmith.evaluate.acceptance import replay

    # 7 steps may start (end = 7); drafts from m agree with the text for runs [_, 2, 0, 1, 0, 3, 0, 0]
    runs = [0, 2, 0, 1, 0, 3, 0, 0]
    accept = np.array([[1.0 if j <= runs[m] else 0.0 for j in range(4)] for m in range(8)])
    steps, accepted, by_position = replay(accept, 7, 3)
    # m=1 keeps 2 (next m=4), m=4 keeps 0 (m=5), m=5 keeps 3 (m=9 > end): 3 steps, 5 accepted
    assert (steps, accepted) == (3, 5) and by_position.tolist() == [2, 2, 1]
    assert replay(accept, 7, 1)[:2] == (4, 3)  # K=1: steps at m = 1, 3, 5 (each keeps its draft) and 7 (keeps none)
    half = np.full((4, 3), 0.5)
    steps, accepted, _ = replay(half, 3, 2)  # P(step at 2) = 0.5, at 3 = 0.25 + 0.25
    assert steps == pytest.approx(1 + 0.5 + 0.5) and accepted == pytest.approx(0.75 * 2)


def report(shipped: str, k: int, **rates_taus) -> dict:
    """proposer=((acceptance rate, tau) at K = 1, (acceptance rate, tau) at the chosen K)."""
    rows = [
        {"proposer": name, "temperature": 0.0, "k": kk, "acceptance_rate": rate, "tau": tau}
        for name, by_k in rates_taus.items()
        for kk, (rate, tau) in zip((1, k), by_k)
    ]
    return {"shipped": shipped, "num_speculative_tokens": k, "acceptance": rows}


def thresholds_of(min_alpha: float, max_tau_loss: float, alpha_gate: str = "hard") -> SimpleNamespace:
    return SimpleNamespace(min_alpha=min_alpha, max_tau_loss=max_tau_loss, alpha_gate=alpha_gate)


def test_gates_on_alpha_and_on_the_w4a16_tau_loss():
    thresholds = thresholds_of(0.55, 0.03)
    quantized = report("w4a16", 2, w4a16=((0.625, 1.625), (0.625, 2.25)), bf16=((0.75, 1.75), (0.75, 2.5)))
    result = gates(thresholds, quantized)
    assert result["min_alpha"]["value"] == pytest.approx(0.625) and result["min_alpha"]["passed"]
    assert result["max_tau_loss"]["value"] == pytest.approx(0.1) and not result["max_tau_loss"]["passed"]
    assert not result["passed"]
    assert gates(thresholds_of(0.55, 0.1), quantized)["passed"]
    only_bf16 = report("bf16", 2, bf16=((0.75, 1.75), (0.75, 2.5)))
    passed = gates(thresholds_of(0.7, 0.03), only_bf16)
    assert passed["passed"] and passed["max_tau_loss"]["value"] is None
    assert not gates(thresholds_of(0.8, 0.03), only_bf16)["passed"]


def test_the_alpha_gate_reads_k1_so_a_longer_k_that_pays_is_not_refused():
    # the H200 head: alpha 0.764 at K = 1, but 0.35 of its drafts kept at the chosen K = 7
    head = report("eagle3", 7, eagle3=((0.764, 1.764), (0.3535, 3.474)))
    result = gates(thresholds_of(0.55, 0.03), head)
    assert result["passed"] and result["min_alpha"]["value"] == pytest.approx(0.764)
    assert not gates(thresholds_of(0.8, 0.03), head)["passed"]


def test_the_alpha_gate_warns_by_default_and_holds_a_draft_back_only_when_hard():
    head = report("eagle3", 4, eagle3=((0.52, 1.52), (0.3, 2.2)))
    soft = gates(thresholds_of(0.55, 0.03, "warn"), head)
    assert soft["passed"] and soft["warnings"] == ["min_alpha"] and not soft["min_alpha"]["passed"]
    hard = gates(thresholds_of(0.55, 0.03, "hard"), head)
    assert not hard["passed"] and hard["warnings"] == []
    # the tau-loss gate stays hard whatever alpha_gate says
    quantized = report("w4a16", 2, w4a16=((0.625, 1.625), (0.625, 2.25)), bf16=((0.75, 1.75), (0.75, 2.5)))
    assert not gates(thresholds_of(0.55, 0.03, "warn"), quantized)["passed"]


def test_the_bundles_alert_fires_below_its_own_measured_acceptance():
    import yaml

    from draftsmith.pipeline.publish import alert_rules

    # greedy keeps 40% of the drafts at K = 3, sampling 32%: the alert fires below 75% of the lower
    measured = {**report("eagle3", 3, eagle3=((0.6, 1.6), (0.4, 2.2))), "temperatures": [0.0, 0.7]}
    measured["acceptance"].append({"proposer": "eagle3", "temperature": 0.7, "k": 3, "acceptance_rate": 0.32, "tau": 1.96})
    rule = yaml.safe_load(alert_rules(measured))["groups"][0]["rules"][0]
    assert rule["expr"].strip().endswith("< 0.24") and "at K=3" in rule["annotations"]["summary"]


def run(*args, cwd):
    return subprocess.run(
        [DRAFTSMITH, "run", *args], cwd=cwd, capture_output=True, text=True, timeout=900, env={**os.environ, "COLUMNS": "200"}
    )


def only_output(root: Path, stage: str) -> Path:
    outputs = [p for p in (root / stage).iterdir() if not p.name.startswith(".")]
    assert len(outputs) == 1, outputs
    return outputs[0]


@pytest.fixture(scope="module")
def evaluated(tiny_chat_target, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("eval")
    args = (
        "experiment=t",
        "target=hf",
        f"target.name_or_path={tiny_chat_target}",
        f"paths.root={tmp / 'runs'}",
        "tracking.enabled=false",
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
        "evaluate.max_speculative_tokens=5",
        "target.dtype=float32",
        "evaluate.speed_repeats=3",
    )  # float32: exact on a CPU (in bf16 a K+1-token and a 1-token forward round differently)
    done = run(*args, cwd=tmp)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return tmp, args, done


def rows_at(report: dict, proposer: str, k: int) -> dict:
    return next(r for r in report["acceptance"] if (r["proposer"], r["temperature"], r["k"]) == (proposer, 0.0, k))


def test_eval_json_covers_every_proposer_k_and_temperature(evaluated):
    tmp, _, done = evaluated
    out = only_output(tmp / "runs", "evaluate")
    report = json.loads((out / "eval.json").read_text())
    assert report["shipped"] == "w4a16"
    assert set(report["proposers"]) == {"w4a16", "bf16", "initial", "prompt_lookup", "lookup_first"}
    assert "--lookup-first 3" in report["proposers"]["lookup_first"] and "| lookup_first |" in (out / "eval.md").read_text()
    for name in report["proposers"]:
        for t in (0.0, 0.7):
            ks = sorted(r["k"] for r in report["acceptance"] if r["proposer"] == name and r["temperature"] == t)
            assert ks == [1, 2, 3, 4, 5], (name, t)
    for row in report["acceptance"]:
        assert 0.0 <= row["acceptance_rate"] <= 1.0 and 1.0 <= row["tau"] <= row["k"] + 1
        # tau = 1 + acceptance rate x K, by the counters' definitions (serve/stats.py)
        assert row["tau"] == pytest.approx(1 + row["acceptance_rate"] * row["k"])
        assert len(row["acceptance_by_position"]) == row["k"]
    assert 1 <= report["num_speculative_tokens"] <= 5 and report["why"]
    # the engine at the chosen K: lossless (the same tokens as plain decoding) and the computed counters exact
    check = report["cross_check"]
    assert check["outputs_equal_plain"] and check["difference"] == 0.0, check
    assert [r["k"] for r in report["engine"]] == [0, report["num_speculative_tokens"]]
    assert report["speed"]["measured_speedup"]["w4a16"][str(report["num_speculative_tokens"])] > 0
    runs = report["speed"]["runs_tokens_per_s"]  # evaluate.speed_repeats: 3 runs each, the medians reported
    assert len(runs["plain"]) == len(runs["w4a16"]) == 3
    assert report["speed"]["plain_tokens_per_s"] == sorted(runs["plain"])[1]
    assert report["speed"]["tokens_per_s"] == sorted(runs["w4a16"])[1]
    # drafts of one shape are timed once (W4A16 runs dequantized); prompt lookup has steps of its own
    step_ms = report["speed"]["step_ms"]
    assert step_ms["w4a16"] == step_ms["bf16"] == step_ms["initial"] != step_ms["prompt_lookup"]
    # the plain step, timed in the same turns as each proposer's
    assert report["speed"]["plain_step_ms"] == step_ms["w4a16"]["0"] and set(step_ms["w4a16"]) == {str(k) for k in range(6)}
    faster = report["speed"]["faster_than_plain"]
    assert faster == [int(k) for k, ms in step_ms["w4a16"].items() if k != "0" and ms < 0.9 * step_ms["w4a16"]["0"]]
    # where the step costs were disturbed, eval.md says so
    disturbed = reports.markdown({**report, "speed": {**report["speed"], "faster_than_plain": [2, 5]}})
    assert "Steps at K=2,5 timed faster than a plain step" in disturbed
    assert ("timed faster than a plain step" in (out / "eval.md").read_text()) == bool(faster)
    for name in ("eval.md", "acceptance_by_position.png", "tau_vs_k.png", "speedup.png"):
        assert (out / name).stat().st_size > 0
    assert "tau_k5_initial" in done.stdout and "tau_k5_prompt_lookup" in done.stdout
    metrics = json.loads((out / "stage.json").read_text())["metrics"]  # alpha per drafted token; the rate at K
    assert metrics["alpha"] == rows_at(report, "w4a16", 1)["acceptance_rate"]
    assert metrics["acceptance_rate"] == rows_at(report, "w4a16", report["num_speculative_tokens"])["acceptance_rate"]
    k = report["num_speculative_tokens"]
    # the K that pays by batch size: whole steps timed at each of evaluate.dynamic_k_batch_sizes, a schedule from 1
    dynamic = report["dynamic_k"]
    assert dynamic["batch_sizes"][0] == 1 and set(dynamic["step_ms"]) == {str(b) for b in dynamic["batch_sizes"]}
    schedule = dynamic["schedule"]
    assert schedule[0][0] == 1 and all(0 <= entry[2] <= k for entry in schedule)
    assert all(later[0] == earlier[1] + 1 for earlier, later in zip(schedule, schedule[1:]))
    md = (out / "eval.md").read_text()
    assert f"| alpha | kept K={k} |" in md
    assert f"| {rows_at(report, 'w4a16', 1)['acceptance_rate']:.3f} | {rows_at(report, 'w4a16', k)['acceptance_rate']:.3f} |" in md
    # every proposer's predicted speedup by K; one that would out-decode the shipped draft is named
    assert f"**Predicted speedup over plain decoding at batch {report['speed']['batch_size']}**" in md
    assert all(f"| {name} | " in md for name in report["speed"]["predicted_speedup"])
    predicted = report["speed"]["predicted_speedup"]
    rigged = {**report["speed"], "predicted_speedup": {**predicted, "prompt_lookup": {"3": 9.0}}}
    best = max(predicted["w4a16"].values())
    named = f"prompt_lookup is predicted faster than the shipped draft here: 9.00x at K=3 against {best:.2f}x."
    assert named in reports.markdown({**report, "speed": rigged})
    as_ints = {name: {int(k): v for k, v in curve.items()} for name, curve in predicted.items()}
    assert ("predicted faster than the shipped draft" in md) == bool(faster_than_shipped(as_ints, "w4a16"))


def test_a_proposer_predicted_faster_than_the_shipped_draft_is_named_at_its_best_k():
    predicted = {"eagle3": {1: 1.56, 3: 1.82, 5: 1.69}, "prompt_lookup": {3: 1.89, 7: 2.11, 8: 2.04}, "initial": {1: 0.95}}
    assert faster_than_shipped(predicted, "eagle3") == [("prompt_lookup", 7, 2.11)]  # the H100's qwen_coder run, 2026-12-05
    assert faster_than_shipped(predicted, "prompt_lookup") == []
    assert faster_than_shipped({**predicted, "initial": {2: 2.5}}, "eagle3") == [("initial", 2, 2.5), ("prompt_lookup", 7, 2.11)]
    assert faster_than_shipped({**predicted, "prompt_lookup": {3: 1.85}}, "eagle3") == []  # within the timings' noise
    # a W4A16 draft's bf16 twin costs the same timed steps: only what quantization loses tells them apart (gated)
    assert faster_than_shipped({"w4a16": {1: 1.41}, "bf16": {1: 1.6}, "prompt_lookup": {1: 1.0}}, "w4a16") == []


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
    bundles = lambda: sorted(p for p in (tmp / "runs" / "publish").iterdir() if not p.name.startswith("."))
    before = len(bundles())
    strict = [a for a in args if not a.startswith("evaluate.min_alpha")] + ["evaluate.min_alpha=0.999"]
    # by default the alpha gate warns: the draft is published, and its card says why it was all the same
    warned = run(*strict, cwd=tmp)
    assert warned.returncode == 0, warned.stdout[-2000:]
    assert "evaluation gate min_alpha" in warned.stdout and "published all the same" in warned.stdout
    assert len(bundles()) == before + 1
    card = max(bundles(), key=lambda p: p.stat().st_mtime) / "bundle" / "README.md"
    assert "**Warning**: alpha of" in card.read_text() and "evaluate.alpha_gate=hard" in card.read_text()
    hard = [*strict, "evaluate.alpha_gate=hard"]
    failed = run(*hard, cwd=tmp)
    assert failed.returncode == 1
    assert "evaluation gate failed: min_alpha" in failed.stdout and "publish.override_gates=true" in failed.stdout
    assert "│ evaluate │ cached" not in failed.stdout  # no summary: the job stopped at the gate
    assert len(bundles()) == before + 1  # the thresholds are the publish stage's: nothing new was published
    overridden = run(*hard, "publish.override_gates=true", cwd=tmp)
    assert overridden.returncode == 0, overridden.stdout[-2000:]
    assert len(bundles()) == before + 2 and "gates_overridden=True" in overridden.stdout


# -- one teacher-forced pass against the engine ---------------------------------------------------------


def one_pass_and_engine(target_dir, draft, prompts, params, k_max=8, eos=frozenset()):
    """The computed rows for K = 1..k_max, and a function running the engine at K."""
    import torch

    from draftsmith.evaluate.acceptance import acceptance, computed_rows, measure, references
    from draftsmith.serve.engine import Engine
    from draftsmith.serve.proposers import PromptLookup
    from draftsmith.serve.weights import load_model

    target = load_model(target_dir, torch.float64)
    refs = references(Engine(target, max_batch_size=8, max_seq_len=64, eos_token_ids=eos), prompts, params, k_max)
    rows = computed_rows("p", params.temperature, acceptance(target, {"p": draft}, refs, params, k_max, 8)["p"], refs, k_max)
    engine = Engine(target, draft, max_batch_size=8, max_seq_len=64, eos_token_ids=eos)
    proposer = PromptLookup(target.args.vocab_size) if draft is None else None
    return rows, lambda k: measure(engine, "p", prompts, params, k, proposer)


@pytest.fixture(scope="module")
def small_head(tiny_models, tmp_path_factory):
    """An EAGLE-3 head trained for 60 steps on the tiny SmolLM2-shaped target's greedy text."""
    from tests.test_eagle import distill_config, distiller, greedy_rows

    target_dir = tiny_models["smollm2"][0]
    tmp = tmp_path_factory.mktemp("head")
    d = distiller(target_dir, greedy_rows(target_dir, n=128), tmp / "work", distill_config(max_steps=60, eval_every=60))
    d.train()
    d.save_draft(tmp / "head")
    return tmp / "head"


@pytest.mark.parametrize("kind", ["draft model", "eagle3", "prompt lookup"])
def test_computed_acceptance_is_the_engines_at_t0(tiny_models, small_head, kind):
    """alpha, tau and acceptance by position from one pass equal the engine's counters for K = 1..8, with
    sequences ending at EOS and at max_new_tokens."""
    import torch

    from draftsmith.serve.eagle import load_head
    from draftsmith.serve.sampling import SamplingParams
    from draftsmith.serve.weights import load_model
    from tests.test_speculative import random_prompts

    family = "smollm2" if kind == "eagle3" else "qwen2"
    target_dir, draft_dir = tiny_models[family]
    draft = {
        "draft model": lambda: load_model(draft_dir, torch.float64),
        "eagle3": lambda: load_head(small_head, torch.float64),
        "prompt lookup": lambda: None,
    }[kind]()
    prompts = [[i % 5 + j for i in range(10)] for j in range(16)] if kind == "prompt lookup" else random_prompts(24, 97, seed=9)
    rows, engine_at = one_pass_and_engine(target_dir, draft, prompts, SamplingParams(max_new_tokens=14), eos=frozenset({7}))
    for row in rows:
        measured = engine_at(row.k).stats
        assert (measured.num_drafts, measured.num_accepted_tokens) == (row.steps, row.accepted), row.k
        assert measured.accepted_per_position == row.by_position, row.k
    assert rows[-1].accepted > 10  # acceptance paths ran


@pytest.mark.parametrize("min_match", [1, 3])
def test_computed_lookup_first_acceptance_is_the_engines_at_t0(tiny_models, min_match):
    """The shipped draft with prompt lookup first, computed from the draft's and the lookup's passes (eval.md's
    lookup_first row), equals the engine's counters with LookupFirst, at batch 8 (the choice is per row)."""
    import torch

    from draftsmith.evaluate.acceptance import acceptance, computed_rows, lookup_first, measure, references
    from draftsmith.serve.engine import Engine
    from draftsmith.serve.proposers import LookupFirst
    from draftsmith.serve.sampling import SamplingParams
    from draftsmith.serve.weights import load_model
    from tests.test_speculative import random_prompts

    target_dir, draft_dir = tiny_models["qwen2"]  # repeating prompts and random ones: both proposers draft, and differ
    target, draft = load_model(target_dir, torch.float64), load_model(draft_dir, torch.float64)
    prompts = [[i % 4 + j for i in range(10)] for j in range(8)] + random_prompts(8, 97, seed=5)
    params, k_max = SamplingParams(max_new_tokens=20), 6
    refs = references(Engine(target, max_batch_size=8, max_seq_len=64), prompts, params, k_max)
    accepts = acceptance(target, {"draft": draft, "lookup": None}, refs, params, k_max, 8)
    mixed = lookup_first(accepts["draft"], accepts["lookup"], refs, min_match)
    engine = Engine(target, draft, max_batch_size=8, max_seq_len=64)
    for row in computed_rows("lookup_first", 0.0, mixed, refs, k_max):
        measured = measure(engine, "lookup_first", prompts, params, row.k, LookupFirst(engine.draft_proposer, 97, min_match)).stats
        assert (measured.num_drafts, measured.num_accepted_tokens) == (row.steps, row.accepted), row.k
        assert measured.accepted_per_position == row.by_position, row.k
    alone = computed_rows("draft", 0.0, accepts["draft"], refs, k_max)
    assert [r.accepted for r in alone] != [r.accepted for r in computed_rows("lookup_first", 0.0, mixed, refs, k_max)]


def test_computed_acceptance_at_t1_is_the_engines_expectation(tiny_models):
    """At T > 0 the pass gives the expected counters on target-sampled text; the engine's, on its own
    samples, agree within sampling error."""
    import torch

    from draftsmith.serve.sampling import SamplingParams
    from draftsmith.serve.weights import load_model
    from tests.test_speculative import random_prompts

    target_dir, draft_dir = tiny_models["qwen2"]
    prompts = random_prompts(400, 97, seed=10)
    params = SamplingParams(temperature=1.0, seed=3, max_new_tokens=12)
    rows, engine_at = one_pass_and_engine(target_dir, load_model(draft_dir, torch.float64), prompts, params, k_max=3)
    measured = engine_at(3).stats
    assert 0.2 < rows[2].acceptance_rate < 0.9
    assert measured.tau == pytest.approx(rows[2].tau, abs=0.06)
    assert measured.acceptance_rate == pytest.approx(rows[2].acceptance_rate, abs=0.03)


def test_drafts_of_one_shape_share_step_costs(tiny_chat_target, tmp_path):
    from draftsmith.evaluate.stage import same_shape
    from draftsmith.serve.engine import load_draft
    from tests.conftest import save_truncated_draft

    two = save_truncated_draft(tiny_chat_target, tmp_path / "two", keep_layers=2)
    one = save_truncated_draft(tiny_chat_target, tmp_path / "one", keep_layers=1)
    load = lambda path, vocab=None: load_draft(path, torch.float32, "cpu", vocab)
    assert same_shape(load(two), load(two)) and not same_shape(load(two), load(one))
    assert not same_shape(load(two), None) and not same_shape(None, None)
    assert not same_shape(load(two), load(two, range(64)))  # a vocabulary subset makes the head cheaper
    assert same_shape(load(two, range(64)), load(two, range(64, 128)))


def test_bench_decode_runs_every_row_alike_and_speculative_rows_emit_plain_decodings_tokens(tiny_models):
    from draftsmith.evaluate.bench_decode import run_bench
    from tests.test_speculative import random_prompts

    target_dir, draft_dir = tiny_models["llama"]
    prompts = random_prompts(3, 97, seed=4)
    rows = run_bench(
        target_dir,
        [draft_dir],
        prompts,
        new_tokens=12,
        ks=(1, 3),
        device="cpu",
        dtype="float64",
        repeats=2,
        batch=2,
        lookup=True,
        device_lookup=True,
    )
    assert [r.method for r in rows] == [
        "plain, eager",
        "draft K=1, eager",
        "draft K=3, eager",
        "draft + lookup K=1, eager",
        "draft + lookup K=3, eager",
        "draft + device lookup K=1, eager",
        "draft + device lookup K=3, eager",
        "prompt lookup K=1, eager",
        "prompt lookup K=3, eager",
        "plain, batch 2",
        "draft adaptive K<=3, batch 2",
        "draft + lookup adaptive K<=3, batch 2",
        "draft + device lookup adaptive K<=3, batch 2",
        "prompt lookup adaptive K<=3, batch 2",
    ]
    assert all(len(r.runs_tokens_per_s) == 2 and r.tokens_per_s > 0 for r in rows)  # every row: the same repeats
    plain, k1, k3, both1, both3, device1, device3, lookup1, lookup3, plain_batch, adaptive, both_batch, device_batch, lookup_batch = rows
    assert plain.tokens == k1.tokens == k3.tokens == both3.tokens == device3.tokens == lookup3.tokens == 3 * 12
    assert plain_batch.tokens == adaptive.tokens == both_batch.tokens == device_batch.tokens == lookup_batch.tokens == 8 * 12
    assert plain.target_steps == 3 * 11  # each prompt's first token comes from its prefill
    # the same tokens as batch 1's plain decoding, compared, not counted; plain batching too
    assert all(r.matches_plain for r in rows[1:])
    assert k3.tau > 1 and k3.target_steps < plain.target_steps  # drafts were kept: fewer target steps
    assert lookup1.tau is not None and lookup3.acceptance_rate is not None  # prompt lookup's rows count what it drafted
    assert (device1.tau, device3.tau) == (both1.tau, both3.tau)  # lookup first decides alike on the host and the device


def test_a_bench_row_says_how_many_sequences_part_from_plain_decoding_and_where():
    from draftsmith.evaluate.bench_decode import BenchRow, results_table

    plain = [[5, 6, 7, 8], [1, 2, 3], [9, 9, 9]]
    row = BenchRow("draft", tokens=10, target_steps=5)
    row.compare([[5, 6, 7, 8], [1, 2, 3], [9, 9, 9]], plain)
    assert (row.matches_plain, row.differing, row.first_difference) == (True, 0, None)
    row.compare([[5, 6, 4, 8], [1, 2, 3], [9, 9]], plain)  # a token changed at index 2; a sequence cut short at 2
    assert (row.matches_plain, row.differing, row.first_difference) == (False, 2, 2)
    row.compare([[5, 6, 7, 8], [0, 2, 3], [9, 9, 9]], plain)
    assert (row.matches_plain, row.differing, row.first_difference) == (False, 1, 0)
    # in a 16-bit dtype the table says why a row may part; in float32 a parting row stands unexplained
    plain_row = BenchRow("plain, eager", tokens=10, target_steps=10, runs_tokens_per_s=[100.0])
    row.runs_tokens_per_s = [150.0]
    assert "--dtype float32 compares exactly" in results_table([plain_row, row], "t", "bfloat16").caption
    assert results_table([plain_row, row], "t", "float32").caption is None
    row.compare(plain, plain)
    assert results_table([plain_row, row], "t", "bfloat16").caption is None


def test_bench_decode_stops_at_eos_when_asked_and_every_row_stops_alike(tiny_models, tmp_path):
    # a copy of the target whose EOS is a token its greedy text reaches early: with stop_at_eos every row's answers
    # end there (fewer tokens than asked), and speculative rows still emit plain decoding's tokens
    import json
    import shutil

    from draftsmith.evaluate.bench_decode import run_bench
    from draftsmith.serve.engine import Engine
    from draftsmith.serve.sampling import SamplingParams
    from draftsmith.serve.weights import load_model
    from tests.test_speculative import random_prompts

    target_dir, draft_dir = tiny_models["llama"]
    prompts = random_prompts(3, 97, seed=4)
    first = Engine(load_model(target_dir, torch.float64), max_seq_len=64).generate([prompts[0]], SamplingParams(max_new_tokens=12))
    target = shutil.copytree(target_dir, tmp_path / "target")
    for name in ("config.json", "generation_config.json"):
        if (target / name).is_file():
            config = json.loads((target / name).read_text())
            (target / name).write_text(json.dumps({**config, "eos_token_id": first.completions[0].tokens[3]}))
    rows = run_bench(
        target, [draft_dir], prompts, new_tokens=12, ks=(1, 3), device="cpu", dtype="float64", repeats=1, batch=2, stop_at_eos=True
    )
    plain, k1, k3, plain_batch, adaptive = rows
    assert plain.tokens == k1.tokens == k3.tokens < 3 * 12  # the first prompt's answer, at least, ended early
    assert plain_batch.tokens == adaptive.tokens < 8 * 12
    assert k1.matches_plain and k3.matches_plain and adaptive.matches_plain


def test_an_eval_json_of_the_earlier_format_reads_in_this_formats_names(tmp_path):
    from draftsmith.evaluate.report import read_report

    old = {
        "format_version": 2,
        "shipped": "w4a16",
        "num_speculative_tokens": 2,
        "acceptance": [
            {"proposer": "w4a16", "temperature": 0.0, "k": k, "alpha": rate, "tau": 1 + rate * k} for k, rate in ((1, 0.6), (2, 0.5))
        ],
        "engine": [{"proposer": "plain", "k": 0, "alpha": 0.0}, {"proposer": "w4a16", "k": 2, "alpha": 0.5}],
    }
    (tmp_path / "eval.json").write_text(json.dumps(old))
    report = read_report(tmp_path / "eval.json")
    assert [r["acceptance_rate"] for r in report["acceptance"]] == [0.6, 0.5] and "alpha" not in report["acceptance"][0]
    assert report["engine"][1]["acceptance_rate"] == 0.5
    result = gates(
        thresholds_of(0.55, 0.03),
        {**report, "shipped": "eagle3", "acceptance": [{**r, "proposer": "eagle3"} for r in report["acceptance"]]},
    )
    assert result["min_alpha"]["value"] == 0.6 and result["passed"]


def test_the_log_of_a_run_through_quantization_holds_our_lines_only(evaluated):
    # llm-compressor's AWQ grid-search bars and GPTQ log lines, transformers' loading bars: none in the log
    _, _, done = evaluated
    log = done.stdout + done.stderr
    assert not any(noise in log for noise in ("Grid search", "| METRIC", "it/s]", "Loading weights", "No accelerator")), log[-3000:]
    assert "stage quantize: ran in" in log


def test_the_bench_commands_say_a_bad_input_in_one_line(tmp_path):
    import socket

    with socket.socket() as s:  # a port that nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (tmp_path / "empty").mkdir()
    cases = [
        (["decode", "--target", str(tmp_path / "empty"), "--device", "cpu"], "has no config.json"),
        (["serve", "--url", f"http://127.0.0.1:{port}", "--duration", "1", "--concurrency", "1"], "the server did not answer"),
        (["serve", "--prompts", str(tmp_path / "gone.jsonl")], "gone.jsonl: no such file or directory"),
    ]
    for args, said in cases:
        done = subprocess.run([DRAFTSMITH, "bench", *args], capture_output=True, text=True, timeout=300)
        assert done.returncode == 1 and "error: " in done.stderr and said in done.stderr, done.stderr[-2000:]
        assert "Traceback" not in done.stderr
