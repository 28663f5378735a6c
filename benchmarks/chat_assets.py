"""A general-chat domain for the EAGLE-3 head's recipe (issue 38): AlpacaEval's 805 instructions (self-instruct,
koala, vicuna, oasst and helpful-base questions), which the alpaca-eval 0.6.6 source distribution on PyPI ships
as example/outputs.json, written one prompt a line for the data stage.

    .venv/bin/python benchmarks/chat_assets.py [--cache-dir ~/.cache/draftsmith] [--copy FILE]

Writes <cache-dir>/chat/alpaca_eval.jsonl ({"prompt", "source"} a line); `--copy FILE` also writes it there (for
the GPU machine: `.gpu/alpaca_eval.jsonl`, about 0.3 MB, which `h200_bench.sh eagle_chat` reads).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

PACKAGE, VERSION = "alpaca-eval", "0.6.6"
MEMBER = f"alpaca_eval-{VERSION}/example/outputs.json"
DATA = "alpaca_eval.jsonl"


def alpaca_eval_prompts(folder: Path) -> Path:
    path = folder / DATA
    if path.is_file():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", "-d", tmp, f"{PACKAGE}=={VERSION}"],
            check=True,
        )
        with tarfile.open(next(Path(tmp).glob("alpaca_eval-*.tar.gz"))) as sdist:
            examples = json.load(sdist.extractfile(MEMBER))
    partial = path.with_suffix(".tmp")
    partial.write_text("".join(json.dumps({"prompt": e["instruction"], "source": e["dataset"]}) + "\n" for e in examples))
    partial.rename(path)
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--cache-dir", type=Path, default=Path("~/.cache/draftsmith"))
    parser.add_argument("--copy", type=Path, default=None, help="also write the file here")
    args = parser.parse_args()
    path = alpaca_eval_prompts(args.cache_dir.expanduser() / "chat")
    print(f"{path}: {sum(1 for _ in path.open())} prompts")
    if args.copy:
        args.copy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, args.copy)
        print(f"copied to {args.copy}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
