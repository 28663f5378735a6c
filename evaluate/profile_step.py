"""Where a batch-1 decoding step's time goes on a GPU: forward costs by token count, whole-step costs
by K (attention by torch's fused SDPA, then by the runtime's choice, grouped_attention_pays), and the heaviest
kernels of the target's forward over 1 and over K+1 tokens.

    python3 -m draftsmith.evaluate.profile_step [--cache-dir DIR] [--draft DIR] [--k 2]

The draft defaults to 4 of the demo target's layers (timing does not depend on its training).
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from draftsmith.distill.draft import build_from_target, every_nth_layer
from draftsmith.evaluate.cost import time_forward
from draftsmith.pipeline.config import TargetConfig
from draftsmith.pipeline.target import resolve_target_dir
from draftsmith.serve import model
from draftsmith.serve.engine import Engine
from draftsmith.serve.speculative import DecodeState
from draftsmith.serve.weights import load_model, read_config


def time_step(engine: Engine, k: int, repeats: int = 200) -> float:
    """Milliseconds per whole greedy step (one graph replay) at batch 1, rows inactive so nothing moves."""
    device = engine.device
    state = DecodeState(lengths=torch.tensor([64], device=device), pending=torch.zeros(1, dtype=torch.long, device=device),
                        previous=torch.zeros(1, dtype=torch.long, device=device))
    active = torch.zeros(1, dtype=torch.bool, device=device)
    for _ in range(3):
        engine.step_graphs(state, active, k)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        engine.step_graphs(state, active, k)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def top_kernels(target, num_tokens: int, rows: int = 8) -> str:
    from torch.profiler import ProfilerActivity, profile

    tokens = torch.zeros(1, num_tokens, dtype=torch.long, device="cuda")
    positions = (torch.arange(num_tokens, device="cuda") + 64).unsqueeze(0)
    with torch.inference_mode():
        for _ in range(3):
            target(tokens, positions, fused=True)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                target(tokens, positions, fused=True)
            torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=70)


def timings(target_dir: Path, draft_dir: Path, label: str) -> tuple[list[tuple[str, int, float]], object]:
    target, draft = load_model(target_dir, torch.bfloat16, "cuda"), load_model(draft_dir, torch.bfloat16, "cuda")
    engine = Engine(target, draft, max_seq_len=400)
    device = engine.device
    rows = [(f"target forward{label}", t, time_forward(engine.target_forward, 1, t, device, repeats=50)) for t in range(1, 6)]
    rows += [(f"draft forward{label}", t, time_forward(engine.draft_forward, 1, t, device, repeats=50)) for t in (1, 2)]
    rows += [(f"whole step{label}", k, time_step(engine, k)) for k in range(5)]
    return rows, target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cache-dir", default="~/.cache/draftsmith")
    parser.add_argument("--draft", type=Path)
    parser.add_argument("--k", type=int, default=2)
    args = parser.parse_args()
    target_dir = resolve_target_dir(TargetConfig(name_or_path="demo", cache_dir=args.cache_dir, gguf_file=None))
    grouped = model.GROUPED_ATTENTION_MAX_WORK
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        draft_dir = args.draft or build_from_target(
            target_dir, Path(tmp) / "draft", every_nth_layer(read_config(target_dir)["num_hidden_layers"], 4))
        for label, max_work in ((", sdpa", 0), ("", grouped)):  # torch's fused attention; then the runtime's choice
            model.GROUPED_ATTENTION_MAX_WORK = max_work
            more, target = timings(target_dir, draft_dir, label)
            rows += more
    for t in (1, args.k + 1):
        print(f"\nkernels of the target's fused forward over {t} token(s), 10 forwards:")
        print(top_kernels(target, t))
    print(f"\n{'what':<22} {'T or K':>6} {'ms':>8}")
    for what, n, ms in rows:
        print(f"{what:<22} {n:>6} {ms:>8.3f}")


if __name__ == "__main__":
    main()
