"""CPU, aot_eager: how long dynamo + AOT autograd take for the head's training unroll (demo shape, 7 steps)."""
import sys, tempfile, time
from dataclasses import replace
from pathlib import Path
sys.path.insert(0, "benchmarks")
import torch
orig = torch.compile
def compile_aot(fn=None, **kw):
    kw["backend"] = "aot_eager"
    return orig(fn, **kw) if fn is not None else (lambda f: orig(f, **kw))
torch.compile = compile_aot
import profile_train as pt
from draftsmith.pipeline.config import TargetConfig, composed
from draftsmith.serve.weights import read_config
from draftsmith.pipeline.target import resolve_target_dir
from torch._dynamo.utils import counters, compile_times
target_dir = resolve_target_dir(TargetConfig(name_or_path="demo", cache_dir="~/.cache/draftsmith/targets", gguf_file=None))
base = replace(composed("preset=gpu").distill, batch_size=8, max_steps=4, eval_every=10**9, compile=False)
cfg = replace(base, **pt.HEAD_VARIANTS["head, chunked, compiled, length-grouped"])
rows = pt.synthetic_rows(8 * 3, read_config(target_dir)["vocab_size"], seed=0)
with tempfile.TemporaryDirectory() as tmp:
    t = time.time()
    timed, _, compiling = pt.one_run(cfg, target_dir, None, rows, 1, Path(tmp) / "x", True)
print("seconds", round(time.time() - t, 1), "compile", round(compiling, 1), "rates", [round(r[0]) for r in timed])
print(compile_times(repr="str", aggregate=True))
print({k: dict(v) for k, v in counters.items() if k in ("recompiles", "frames", "stats")})
