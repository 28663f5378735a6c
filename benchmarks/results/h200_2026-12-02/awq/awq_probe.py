"""Where the W4A16 TVD rise on the H200 comes from: calibration settings x evaluation dtype."""
import glob, json, os, time
from pathlib import Path
from types import SimpleNamespace

import torch
from transformers import AutoModelForCausalLM

from draftsmith.distill.heldout import compare_drafts
from draftsmith.distill.teacher import load_teacher
from draftsmith.quantize.awq import quantize_awq
from draftsmith.quantize.stage import calibration_samples, size_mb, tensor_sizes
from draftsmith.distill.tokenizer import copy_tokenizer_files

runs = Path("/root/draftsmith-gpu/runs")
newest = lambda pattern: Path(max(glob.glob(str(runs / pattern)), key=os.path.getmtime))
dense = newest("distill/*") / "draft"
teacher = newest("teacher/*")
target = Path(json.loads((newest("target/*") / "target.json").read_text())["path"])
print("dense", dense, "teacher", teacher, "target", target, flush=True)
rows = load_teacher(SimpleNamespace(path=teacher)).to_list()
eval_rows = [r for r in rows if r["split"] == "eval" and r["response_ids"]]
out = Path(os.environ.get("OUT", "/tmp/out"))
table = []

def tvd(models_dirs, dtype):
    load = lambda p: AutoModelForCausalLM.from_pretrained(p, dtype=dtype).to("cuda").eval()
    with torch.no_grad():
        return compare_drafts(load(target), [load(p) for p in models_dirs], eval_rows, 64, 384, "cuda")["tvd"]

for name, samples, length, group in [("default", 128, 512, None), ("gs32", 128, 512, 32), ("512 samples", 512, 512, None)]:
    qdir = Path(f"/root/awq_probe/{name.replace(' ', '_')}")
    started = time.perf_counter()
    done = quantize_awq(dense, target, qdir, calibration_samples(rows, samples, length, 0), bits=4, group_size=group,
                        ignore=["lm_head"], calibration_dtype="float32")
    copy_tokenizer_files(target, qdir)
    took = time.perf_counter() - started
    dtypes = sorted({d for d, _ in tensor_sizes(qdir).values()})
    row = {"setting": name, "group": done["group_size"], "seconds": round(took, 1), "size_mb": size_mb(qdir)["total"], "dtypes": dtypes}
    for label, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        before, after = tvd([dense, qdir], dtype)
        row[f"tvd_{label}"] = f"{before:.4f}->{after:.4f} ({(after / before - 1) * 100:+.2f}%)"
    print(row, flush=True)
    table.append(row)
(out / "awq_probe.json").write_text(json.dumps(table, indent=2))
for row in table:
    print(row)
