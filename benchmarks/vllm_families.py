"""vLLM itself on bundles of other families than Llama: a tiny random-weight target of each (the demo's tokenizer),
the pipeline end to end, then `make vllm-check` on the bundle (vLLM's CPU build).

    .venv/bin/python benchmarks/vllm_families.py [--out DIR] [--pretrain STEPS] [qwen3:eagle3 gemma2:from_target ...]

The targets are the test suite's tiny configs (tests/conftest.py) widened to a head size vLLM's CPU attention
takes (64). Draft models keep the target's whole vocabulary: vLLM's draft_model method proposes from all of it,
while draftsmith can restrict proposals to draft_vocab.json (README, Limits). A random target is degenerate (greedy
decoding repeats one token, so acceptance is 0 or 1 and agreement says little): `--pretrain STEPS` first trains
it as a language model on the demo prompts under its chat template, so that its greedy text varies. Prints one
line per bundle: vLLM's verdict, and its acceptance against eval.json.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

STEPS = [
    "experiment=families",
    "target=hf",
    "data.max_prompts=48",
    "data.eval_fraction=0.25",
    "distill.teacher.max_new_tokens=16",
    "distill.max_steps=30",
    "distill.eval_every=30",
    "draft.num_layers=1",
    "distill.batch_size=8",
    "quantize.num_calibration_samples=8",
    "evaluate.max_new_tokens=24",
    "evaluate.batch_size=4",
    "evaluate.min_alpha=0.0",
    "evaluate.max_tau_loss=1.0",
    "evaluate.max_speculative_tokens=2",
    "evaluate.min_speedup=0.0",
    "tracking.enabled=false",
]


def tiny_target(family: str, path: Path) -> Path:
    from draftsmith.distill.tokenizer import copy_tokenizer_files
    from draftsmith.pipeline.target import convert_gguf, demo_gguf_path
    from tests.conftest import save_tiny_model

    wide = {"hidden_size": 128, "head_dim": 64, "num_attention_heads": 2, "num_key_value_heads": 1}
    ids = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
    save_tiny_model(path, family, seed=0, overrides=wide | ids, vocab_size=49152, num_layers=4)
    copy_tokenizer_files(convert_gguf(demo_gguf_path(), Path.home() / ".cache" / "draftsmith" / "targets"), path)
    return path


def pretrain(path: Path, steps: int, seq_len: int = 96, batch_size: int = 16) -> None:
    """Next-token training of the target in `path` (in place) on the demo prompts, templated as the data stage
    templates them: a few hundred steps give a tiny target varied greedy text."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draftsmith.distill.data import read_records, to_messages
    from draftsmith.serve.protocol import chat_token_ids

    tokenizer = AutoTokenizer.from_pretrained(path)
    stream = [t for r in read_records("demo") if (m := to_messages(r, "prompt")) for t in chat_token_ids(tokenizer, m)]
    windows = torch.tensor(stream[: len(stream) // seq_len * seq_len]).view(-1, seq_len)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    for step in range(steps):
        batch = windows[torch.randint(len(windows), (batch_size,), generator=generator)]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % 100 == 0 or step == steps - 1:
            print(f"  pretrain {path.parent.name}: step {step} loss {loss.item():.3f}", flush=True)
    model.save_pretrained(path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("jobs", nargs="*", default=["qwen3:eagle3", "qwen3:from_target", "gemma2:from_target"])
    parser.add_argument("--out", type=Path, default=Path("/tmp/draftsmith-vllm-families"))
    parser.add_argument("--pretrain", type=int, default=0, help="train each target this many steps first (0: random)")
    args = parser.parse_args()
    lines = []
    for job in args.jobs:
        family, draft = job.split(":")
        work = args.out / f"{family}-{draft}"
        target = tiny_target(family, work / "target")
        if args.pretrain:
            pretrain(target, args.pretrain)
        started = time.perf_counter()
        run = subprocess.run(
            [
                str(ROOT / ".venv/bin/draftsmith"),
                "run",
                *STEPS,
                f"target.name_or_path={target}",
                f"paths.root={work / 'runs'}",
                f"draft={draft}",
                # a draft model proposes from its whole vocabulary in vLLM (a reduced one is draftsmith's own): see Limits
                f"draft.vocab_size={2048 if draft == 'eagle3' else 0}",
            ],
            cwd=work,
            capture_output=True,
            text=True,
        )
        if run.returncode:
            lines.append(f"{job}: the pipeline failed: {(run.stdout + run.stderr)[-800:]}")
            continue
        bundle = next((work / "runs" / "publish").glob("*/bundle"))
        check = subprocess.run(
            ["make", "-s", "vllm-check", f"BUNDLE={bundle}", f"TARGET={target}"], cwd=ROOT, capture_output=True, text=True
        )
        (work / "vllm_check.txt").write_text(check.stdout + check.stderr)
        verdict = check.stdout.strip().splitlines() or check.stderr.strip().splitlines()[-3:]
        lines.append(f"{job}: exit {check.returncode}, {time.perf_counter() - started:.0f} s\n    " + "\n    ".join(verdict))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
