"""Where a decoding step's time goes on a GPU: forward costs by token count, whole-step costs by K
(attention by torch's kernels, then by the runtime's: serve/decode_attention.py), the heaviest
kernels of the target's forward over 1 and over K+1 tokens a row, and of a whole step at K.

    python3 benchmarks/profile_step.py [--cache-dir DIR] [--draft DIR | --layers 4] [--k 2] [--batch 1]

The draft defaults to `--layers` of the demo target's layers, spread (timing does not depend on its training).
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


def idle_rows(engine: Engine) -> tuple[DecodeState, torch.Tensor]:
    """Every row of the engine's batch at position 64, inactive so that nothing moves."""
    device, batch = engine.device, engine.max_batch_size
    zeros = torch.zeros(batch, dtype=torch.long, device=device)
    state = DecodeState(lengths=torch.full((batch,), 64, device=device), pending=zeros, previous=zeros.clone())
    return state, torch.zeros(batch, dtype=torch.bool, device=device)


def time_step(engine: Engine, k: int, repeats: int = 200) -> float:
    """Milliseconds per whole greedy step (one graph replay) at the engine's batch size."""
    state, active = idle_rows(engine)
    for _ in range(3):
        engine.step_graphs(state, active, k)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        engine.step_graphs(state, active, k)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def top_kernels(run, rows: int = 12) -> str:
    """The CUDA kernels of 10 calls of `run`, heaviest first."""
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode():
        for _ in range(3):
            run()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                run()
            torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=70)


def timings(target_dir: Path, draft_dir: Path, label: str, batch: int) -> tuple[list[tuple[str, int, float]], Engine]:
    target, draft = load_model(target_dir, torch.bfloat16, "cuda"), load_model(draft_dir, torch.bfloat16, "cuda")
    engine = Engine(target, draft, max_batch_size=batch, max_seq_len=400)
    device = engine.device
    rows = [(f"target forward{label}", t, time_forward(engine.target_forward, batch, t, device, repeats=50)) for t in range(1, 6)]
    rows += [(f"draft forward{label}", t, time_forward(engine.draft_forward, batch, t, device, repeats=50)) for t in (1, 2)]
    rows += [(f"whole step{label}", k, time_step(engine, k)) for k in range(5)]
    return rows, engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cache-dir", default="~/.cache/draftsmith")
    parser.add_argument("--draft", type=Path)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args()
    target_dir = resolve_target_dir(TargetConfig(name_or_path="demo", cache_dir=args.cache_dir, gguf_file=None))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        draft_dir = args.draft or build_from_target(
            target_dir, Path(tmp) / "draft", every_nth_layer(read_config(target_dir)["num_hidden_layers"], args.layers)
        )
        for label, kernel in ((", torch", False), ("", True)):  # torch's attention kernels; then the runtime's own
            model.USE_DECODE_ATTENTION = kernel
            torch._dynamo.reset()  # the compiled blocks read the choice when they compile
            more, engine = timings(target_dir, draft_dir, label, args.batch)
            rows += more
    for t in (1, args.k + 1):
        tokens = torch.zeros(args.batch, t, dtype=torch.long, device="cuda")
        positions = (torch.arange(t, device="cuda") + 64).expand(args.batch, t)
        print(f"\nkernels of the target's fused forward over {t} token(s) a row at batch {args.batch}, 10 forwards:")
        print(top_kernels(lambda: engine.target(tokens, positions, fused=True)))
    state, active = idle_rows(engine)
    print(f"\nkernels of a whole step at K = {args.k}, batch {args.batch} (graph replays), 10 steps:")
    print(top_kernels(lambda: engine.step_graphs(state, active, args.k), rows=25))
    print(f"\n{'what':<22} {'T or K':>6} {'ms':>8}")
    for what, n, ms in rows:
        print(f"{what:<22} {n:>6} {ms:>8.3f}")


if __name__ == "__main__":
    main()
