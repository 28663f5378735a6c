"""The distribution installs every folder as draftsmith.<folder>, and nothing as a bare top-level name."""

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_file_list_is_namespaced(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(ROOT)],
        check=True,
        capture_output=True,
    )
    wheel = next(tmp_path.glob("draftsmith-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    packages = {n.split("/")[1] for n in names if n.startswith("draftsmith/")}
    assert packages == {"conf", "pipeline", "distill", "quantize", "evaluate", "serve"}
    assert "draftsmith/conf/config.yaml" in names and "draftsmith/conf/preset/demo.yaml" in names
    assert "draftsmith/serve/speculative.py" in names
    assert "draftsmith/__init__.py" not in names  # draftsmith is an implicit namespace
    top_level = {n.split("/")[0] for n in names}
    assert top_level <= {"draftsmith", wheel.name.split("-")[0] + "-" + wheel.name.split("-")[1] + ".dist-info"}
    assert not any(n.startswith(("pipeline/", "serve/", "tests/")) for n in names)


def test_installed_package_imports_only_under_draftsmith(tmp_path):
    probe = "import draftsmith.serve, draftsmith.pipeline.cli\ntry:\n import pipeline\nexcept ModuleNotFoundError:\n print('ok')"
    done = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True)
    assert done.stdout.strip() == "ok", done.stderr
