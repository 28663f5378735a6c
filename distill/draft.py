"""Draft construction from the target: its embeddings, final norm, LM head and a subset of its layers.

The result is an ordinary HF model dir (config.json, model.safetensors, the target's tokenizer files)
with the target's vocabulary, so any tool, vLLM included, can open it.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from safetensors.torch import save_file

from draftsmith.distill.tokenizer import check_same_tokenizer, copy_tokenizer_files
from draftsmith.serve.weights import read_config, read_safetensors

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


class DraftError(ValueError):
    """The draft cannot be built as configured; the message says why and what is allowed."""


def every_nth_layer(num_target_layers: int, num_layers: int) -> list[int]:
    """num_layers indices spread evenly over the target, first and last included."""
    if not 1 <= num_layers <= num_target_layers:
        raise DraftError(f"draft.num_layers={num_layers} must be between 1 and the target's {num_target_layers} layers")
    if num_layers == 1:
        return [0]
    step = (num_target_layers - 1) / (num_layers - 1)
    return sorted({round(i * step) for i in range(num_layers)})


def chosen_layers(num_target_layers: int, num_layers: int, choice: str) -> list[int]:
    """num_layers of the target's layers: spread evenly (first and last included), the first n or the last n."""
    spread = every_nth_layer(num_target_layers, num_layers)  # also checks num_layers
    return {"spread": spread, "first": list(range(num_layers)), "last": list(range(num_target_layers - num_layers, num_target_layers))}[
        choice
    ]


def build_from_target(target_dir: Path, out_dir: Path, layers: list[int]) -> Path:
    """Write a draft with the target's layers `layers` (in order) into out_dir."""
    config = read_config(target_dir)
    n = config["num_hidden_layers"]
    if not layers or any(not 0 <= i < n for i in layers):
        raise DraftError(f"draft.layers={layers} must name layers of the target, 0 to {n - 1}")
    renumber = {old: new for new, old in enumerate(layers)}
    tensors = {}
    for name, tensor in read_safetensors(target_dir).items():
        match = _LAYER.match(name)
        if match is None:
            tensors[name] = tensor.contiguous()
        elif int(match.group(1)) in renumber:
            tensors[f"model.layers.{renumber[int(match.group(1))]}.{match.group(2)}"] = tensor.contiguous()
    if config.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)
    config["num_hidden_layers"] = len(layers)
    if isinstance(config.get("layer_types"), list):
        config["layer_types"] = [config["layer_types"][i] for i in layers]
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    copy_tokenizer_files(target_dir, out_dir)
    (out_dir / "draft.json").write_text(json.dumps({"init": "from_target", "target": str(target_dir), "layers": layers}, indent=2))
    return out_dir


def build_scratch(target_dir: Path, out_dir: Path, num_layers: int, seed: int) -> Path:
    """A randomly initialised draft of the target's family and width with num_layers layers."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(target_dir)
    config.num_hidden_layers = num_layers
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[:num_layers]
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(out_dir, safe_serialization=True)
    copy_tokenizer_files(target_dir, out_dir)
    (out_dir / "draft.json").write_text(json.dumps({"init": "scratch", "num_layers": num_layers, "seed": seed}, indent=2))
    return out_dir


def build_pretrained(source: Path, target_dir: Path, out_dir: Path, cache_dir: Path) -> Path:
    """An existing small model as the draft (an HF dir, or a .gguf file converted into cache_dir as a GGUF target
    is); refused unless its tokenizer is the target's."""
    if source.suffix == ".gguf" and source.is_file():
        from draftsmith.pipeline.target import convert_gguf

        source = convert_gguf(source, cache_dir)
    if not (source / "config.json").is_file():
        raise DraftError(f"draft.pretrained_path={source} is neither an HF model dir (no config.json) nor a .gguf file")
    # the same tokens; a chat template of its own may differ (siblings' GGUFs do, in a tool-call instruction's
    # escaping): the draft never applies it, and takes the target's tokenizer files here
    check_same_tokenizer(target_dir, source, template=False)
    shutil.copytree(source, out_dir, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.bin", "*.pt", "*.pth"))
    copy_tokenizer_files(target_dir, out_dir)
    (out_dir / "draft.json").write_text(json.dumps({"init": "pretrained", "source": str(source)}, indent=2))
    return out_dir


def build_draft(cfg, target_dir: Path, out_dir: Path, seed: int, cache_dir: Path = Path("~/.cache/draftsmith")) -> Path:
    """The initial draft of `cfg` (a DraftConfig) in out_dir, on the target's tokenizer (a GGUF pretrained draft
    converted into cache_dir)."""
    init = cfg.init.value
    if init == "from_target":
        n = read_config(target_dir)["num_hidden_layers"]
        layers = list(cfg.layers) or chosen_layers(n, cfg.num_layers, cfg.layer_choice.value)
        return build_from_target(target_dir, out_dir, layers)
    if init == "scratch":
        return build_scratch(target_dir, out_dir, cfg.num_layers, seed)
    if not cfg.pretrained_path:
        raise DraftError("draft.init=pretrained needs draft.pretrained_path (an HF model dir or a .gguf file on the target's tokenizer)")
    return build_pretrained(Path(cfg.pretrained_path).expanduser(), target_dir, out_dir, cache_dir)
