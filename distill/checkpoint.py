"""Training checkpoints without pickles: weights, optimizer and RNG tensors in safetensors, the rest
in JSON. Written to a temporary dir and renamed, so a kill leaves the previous checkpoint whole."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

CHECKPOINT = "checkpoint"


def save(work_dir: Path, model: torch.nn.Module, optimizer, scheduler, progress: dict[str, Any]) -> None:
    tmp, final = work_dir / f"{CHECKPOINT}.tmp", work_dir / CHECKPOINT
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    weights, seen = {}, set()
    for name, value in model.state_dict().items():
        if value.data_ptr() not in seen:  # tied weights (embeddings = LM head) are stored once
            seen.add(value.data_ptr())
            weights[name] = value.detach().contiguous().cpu()
    save_file(weights, str(tmp / "model.safetensors"))
    opt = optimizer.state_dict()
    tensors, scalars = {}, {}
    for index, state in opt["state"].items():
        for name, value in state.items():
            if torch.is_tensor(value):
                tensors[f"{index}.{name}"] = value.contiguous().cpu()
            else:
                scalars[f"{index}.{name}"] = value
    tensors["rng.torch"] = torch.get_rng_state()
    if torch.cuda.is_available():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng.cuda.{i}"] = state
    save_file(tensors, str(tmp / "optimizer.safetensors"))
    meta = {
        "param_groups": opt["param_groups"],
        "scalars": scalars,
        "scheduler": scheduler.state_dict(),
        "python_random": random.getstate(),
        "progress": progress,
    }
    (tmp / "state.json").write_text(json.dumps(meta))
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)


def load(work_dir: Path, model: torch.nn.Module, optimizer, scheduler) -> dict[str, Any] | None:
    """Restore everything from the last checkpoint; return its progress, or None if there is none."""
    final = work_dir / CHECKPOINT
    if not (final / "state.json").is_file():
        return None
    meta = json.loads((final / "state.json").read_text())
    missing, unexpected = model.load_state_dict(load_file(str(final / "model.safetensors")), strict=False)
    if unexpected or not all(_is_tied(model, name) for name in missing):
        raise RuntimeError(f"checkpoint in {final} does not match the model (missing {missing}, unexpected {unexpected})")
    tensors = load_file(str(final / "optimizer.safetensors"))
    state: dict[int, dict[str, Any]] = {}
    for key, value in list(tensors.items()) + list(meta["scalars"].items()):
        if key.startswith("rng."):
            continue
        index, name = key.split(".", 1)
        state.setdefault(int(index), {})[name] = value
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
    scheduler.load_state_dict(meta["scheduler"])
    torch.set_rng_state(tensors["rng.torch"])
    if torch.cuda.is_available():
        torch.cuda.set_rng_state_all([tensors[k] for k in sorted(k for k in tensors if k.startswith("rng.cuda."))])
    state_tuple = meta["python_random"]
    random.setstate((state_tuple[0], tuple(state_tuple[1]), state_tuple[2]))
    return meta["progress"]


def _is_tied(model: torch.nn.Module, name: str) -> bool:
    """Whether parameter `name` shares its storage with another parameter (stored once)."""
    state = model.state_dict()
    return any(other != name and value.data_ptr() == state[name].data_ptr() for other, value in state.items())
