"""The house rules a newcomer relies on: the runtime (serve/) imports nothing above it, no library function
is longer than 80 lines, and the wheel carries code and configs only (no results, scripts or machine paths)."""

import ast
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).parents[1]
LIBRARY = ("conf", "pipeline", "distill", "quantize", "evaluate", "serve")


def imported_modules(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names.append("." * node.level + (node.module or ""))
    return names


def test_the_runtime_imports_nothing_above_it():
    upward = [
        (path.name, name)
        for path in sorted((ROOT / "serve").rglob("*.py"))
        for name in imported_modules(path)
        if name.startswith(("draftsmith.evaluate", "draftsmith.pipeline", "draftsmith.distill", "draftsmith.quantize", ".."))
    ]
    assert upward == []


def test_no_library_function_is_longer_than_80_lines():
    long = [
        (str(path.relative_to(ROOT)), node.name, node.end_lineno - node.lineno + 1)
        for folder in LIBRARY
        for path in sorted((ROOT / folder).rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 80
    ]
    assert long == []


def test_the_wheel_carries_code_and_configs_only(tmp_path):
    import shutil

    # built from a copy: setuptools leaves a build/ folder beside the sources
    skip = shutil.ignore_patterns(".venv*", ".git", "runs", "build", "*.egg-info", ".gpu", ".whl", "__pycache__", ".hypothesis")
    source = shutil.copytree(ROOT, tmp_path / "source", ignore=skip)
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(source)]
    done = subprocess.run(build, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    wheel = next(tmp_path.glob("draftsmith-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        names = [n for n in z.namelist() if not n.startswith("draftsmith-") or ".dist-info/" not in n]
        texts = {n: z.read(n).decode(errors="replace") for n in names}
    assert names and all(n.startswith("draftsmith/") for n in names), [n for n in names if not n.startswith("draftsmith/")]
    assert {n.split("/")[1] for n in names} == set(LIBRARY)
    assert not [n for n in names if "results" in n.split("/") or n.endswith((".sh", ".ipynb")) or "profile_" in n]
    assert not [n for n, text in texts.items() if "/root/" in text or "draftsmith-gpu" in text]
    assert any(n.startswith("draftsmith/conf/preset/") and n.endswith(".yaml") for n in names)
    assert "draftsmith/serve/monitoring/alerts.yml" in names


def test_one_function_turns_a_chat_into_token_ids():
    # the data stage, the server, the benchmarks and the registered model send the same ids for the same chat, a
    # template's own additions (Qwen's default system prompt) included: only serve/protocol.py applies templates
    callers = sorted(
        str(path.relative_to(ROOT))
        for package in LIBRARY
        for path in (ROOT / package).rglob("*.py")
        if ".apply_chat_template(" in path.read_text()
    )
    assert callers == ["serve/protocol.py"]
