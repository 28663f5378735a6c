"""Cached, atomic stages: fingerprints, reuse, reruns downstream only, no half-written output."""

import gc
import json
import weakref
from dataclasses import dataclass

import pytest
import torch

from draftsmith.pipeline.stage import STAGE_JSON, Stage, StageError, fingerprint, run_stage


@dataclass
class Cfg:
    first: dict
    second: dict


calls: list[str] = []


def write_first(cfg, inputs, out):
    calls.append("first")
    (out / "numbers.json").write_text(json.dumps(list(range(cfg.first["n"]))))
    return {"count": cfg.first["n"]}


def write_second(cfg, inputs, out):
    calls.append("second")
    numbers = json.loads((inputs["first"].path / "numbers.json").read_text())
    (out / "total.txt").write_text(str(sum(numbers) * cfg.second["scale"]))
    return {"total": sum(numbers) * cfg.second["scale"]}


FIRST = Stage("first", ("first",), (), write_first)
SECOND = Stage("second", ("second",), ("first",), write_second)


def run_both(cfg, root):
    a = run_stage(FIRST, cfg, {}, root)
    b = run_stage(SECOND, cfg, {"first": a}, root)
    return a, b


def test_fingerprint_is_stable_and_sensitive():
    base = fingerprint({"a": 1, "b": [1, 2]}, {}, {"x": "f"})
    assert base == fingerprint({"b": [1, 2], "a": 1}, {}, {"x": "f"})  # key order does not matter
    assert base != fingerprint({"a": 2, "b": [1, 2]}, {}, {"x": "f"})
    assert base != fingerprint({"a": 1, "b": [1, 2]}, {"sha": "0"}, {"x": "f"})
    assert base != fingerprint({"a": 1, "b": [1, 2]}, {}, {"x": "g"})


def test_second_run_is_cached_and_a_change_reruns_only_downstream(tmp_path):
    calls.clear()
    cfg = Cfg(first={"n": 4}, second={"scale": 2})
    a, b = run_both(cfg, tmp_path)
    assert calls == ["first", "second"] and not a.cached and b.metrics == {"total": 12}
    record = json.loads((b.path / STAGE_JSON).read_text())
    assert record["inputs"]["first"]["fingerprint"] == a.fingerprint and "torch" in record["versions"]

    a2, b2 = run_both(cfg, tmp_path)
    assert calls == ["first", "second"] and a2.cached and b2.cached and b2.path == b.path

    cfg.second["scale"] = 3  # downstream setting: only the second stage reruns
    a3, b3 = run_both(cfg, tmp_path)
    assert calls == ["first", "second", "second"] and a3.cached and not b3.cached
    assert (b3.path / "total.txt").read_text() == "18"

    cfg.first["n"] = 5  # upstream setting: both rerun
    run_both(cfg, tmp_path)
    assert calls[-2:] == ["first", "second"]


def test_a_stage_that_fails_midway_leaves_nothing(tmp_path):
    def half_then_fail(cfg, inputs, out):
        (out / "partial.bin").write_bytes(b"x" * 100)
        raise RuntimeError("disk on fire")

    broken = Stage("broken", ("first",), (), half_then_fail)
    with pytest.raises(StageError, match="stage 'broken' failed: RuntimeError: disk on fire"):
        run_stage(broken, Cfg(first={"n": 1}, second={}), {}, tmp_path)
    assert list((tmp_path / "broken").iterdir()) == []  # no output, no temporary dir

    ok = Stage("broken", ("first",), (), write_first)  # the same stage fixed runs and lands
    out = run_stage(ok, Cfg(first={"n": 1}, second={}), {}, tmp_path)
    assert [p.name for p in (tmp_path / "broken").iterdir()] == [out.path.name]


def test_a_failed_stage_lets_go_of_what_it_loaded(tmp_path):
    """A sweep keeps a failed job's error until it ends: the error must not keep the stage's model alive."""
    loaded = []

    def load_then_fail(cfg, inputs, out):
        model = torch.nn.Linear(64, 64)  # what a stage holds when it fails: a target, say
        loaded.append(weakref.ref(model))
        raise RuntimeError("out of memory")

    with pytest.raises(StageError) as failed:
        run_stage(Stage("distill", ("first",), (), load_then_fail), Cfg(first={"n": 1}, second={}), {}, tmp_path)
    gc.collect()
    assert loaded[0]() is None
    assert "out of memory" in str(failed.value) and failed.value.__cause__ is not None  # the error itself stays whole


def test_an_incomplete_output_is_rebuilt(tmp_path):
    cfg = Cfg(first={"n": 2}, second={})
    out = run_stage(FIRST, cfg, {}, tmp_path)
    (out.path / STAGE_JSON).unlink()  # as if killed between writing files and stage.json
    again = run_stage(FIRST, cfg, {}, tmp_path)
    assert not again.cached and (again.path / STAGE_JSON).is_file()
