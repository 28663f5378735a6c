"""Shared fixtures: tiny random models of each supported family, saved as real HF dirs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("DO_NOT_TRACK", "true")
if os.environ.get("PYTEST_XDIST_WORKER"):  # one thread per worker (and per pipeline it starts): workers share the cores
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "phi3", "smollm2")  # the runtime's; tiny_config
# also makes "granite", which the runtime does not implement (the transformers fallback's tests)


def tiny_distill_config(teacher: dict | None = None, **overrides):
    """A distill config for a few training steps on the CPU; keyword arguments override its fields, `teacher` its
    teacher config's."""
    from draftsmith.pipeline.config import DistillConfig, DistillLoss, TeacherConfig

    teacher_config = dict(max_new_tokens=8, temperature=0.0, extra_samples=0, sample_temperature=0.8, top_k_logits=0, batch_size=8)
    fields = dict(
        teacher=TeacherConfig(**{**teacher_config, **(teacher or {})}),
        loss=DistillLoss.forward_kl,
        temperature=1.0,
        jsd_beta=0.5,
        learning_rate=1e-2,
        warmup_steps=0,
        max_steps=1,
        batch_size=8,
        grad_accum_steps=1,
        max_grad_norm=1.0,
        eval_every=1,
        max_seq_len=24,
    )
    return DistillConfig(**{**fields, **overrides})


def interpreted(code: str) -> float:
    """Run `code` under triton's interpreter (TRITON_INTERPRET=1: kernels on CPU tensors; it must be on before triton
    is imported, so in a subprocess) and return the number it prints last (a kernel's worst error)."""
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return float(done.stdout.strip().splitlines()[-1])


def tiny_config(family: str, vocab_size: int = 97, num_layers: int = 3):
    from transformers import Gemma2Config, Gemma3TextConfig, LlamaConfig, MistralConfig, Phi3Config, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    if family == "llama":  # Llama 3.1-style rope scaling, untied head
        return LlamaConfig(
            **common,
            tie_word_embeddings=False,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
    if family == "qwen2":  # q/k/v bias, tied head, YaRN RoPE (the long-context config)
        yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 1000000.0}
        return Qwen2Config(**common, tie_word_embeddings=True, rope_parameters=yarn)
    if family == "qwen3":  # q/k RMSNorm per head, an explicit head_dim other than hidden / heads, tied head
        return Qwen3Config(**common, head_dim=32, tie_word_embeddings=True, rope_theta=1000000.0)
    if family == "mistral":  # a sliding window smaller than the tests' contexts
        return MistralConfig(**common, tie_word_embeddings=False, sliding_window=16)
    gemma = dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=8, tie_word_embeddings=True)
    if family == "gemma2":  # sliding and global layers in turn, soft-capped attention scores and logits
        return Gemma2Config(**common, **gemma, attn_logit_softcapping=5.0, final_logit_softcapping=3.0)
    if family == "gemma3":  # q/k norms, sliding layers with a RoPE base of their own, a global layer last
        rope = {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0},
        }
        types = ["sliding_attention"] * (num_layers - 1) + ["full_attention"]
        return Gemma3TextConfig(**common, **gemma, rope_parameters=rope, layer_types=types)
    if family == "phi3":  # half of each head rotates, LongRoPE factors, fused weights in the checkpoint
        rotary = 8  # head_dim 16 x partial_rotary_factor 0.5: 4 frequencies
        longrope = {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
            "short_factor": [1.0, 1.5, 2.0, 3.0][: rotary // 2],
            "long_factor": [2.0, 4.0, 8.0, 16.0][: rotary // 2],
            "original_max_position_embeddings": 256,
        }
        return Phi3Config(**common, tie_word_embeddings=False, rope_parameters=longrope, original_max_position_embeddings=256)
    if family == "granite":  # not in the runtime (multipliers on embeddings, residuals, attention, logits): the fallback's
        from transformers import GraniteConfig

        return GraniteConfig(
            **common,
            tie_word_embeddings=True,
            embedding_multiplier=4.0,
            residual_multiplier=0.5,
            attention_multiplier=0.1,
            logits_scaling=2.0,
        )
    if family == "smollm2":  # SmolLM2's shape in miniature: tied, 3:1 GQA, head_dim 16
        return LlamaConfig(
            **{**common, "num_attention_heads": 6, "num_key_value_heads": 2, "hidden_size": 96},
            tie_word_embeddings=True,
            rope_theta=100000.0,
        )
    raise ValueError(family)


def save_tiny_model(path: Path, family: str, seed: int, overrides: dict | None = None, **kwargs) -> Path:
    """A random-weight model of the family's tiny config (kwargs: tiny_config's; overrides: config attributes)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_config(family, **kwargs)
    for key, value in (overrides or {}).items():
        setattr(config, key, value)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # larger-than-default weights give peaked, varied distributions
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    model.save_pretrained(path)
    return path


def save_truncated_draft(target_dir: Path, path: Path, keep_layers: int) -> Path:
    """A draft made the way from_target drafts are: the target's embeddings, norm, head and first layers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_dir)
    model.model.layers = model.model.layers[:keep_layers]
    model.config.num_hidden_layers = keep_layers
    if hasattr(model.config, "layer_types") and model.config.layer_types:
        model.config.layer_types = model.config.layer_types[:keep_layers]
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """family -> (target dir, draft dir) for every supported family."""
    root = tmp_path_factory.mktemp("tiny")
    out = {}
    for i, family in enumerate(FAMILIES):
        target = save_tiny_model(root / f"{family}-target", family, seed=i)
        out[family] = (target, save_truncated_draft(target, root / f"{family}-draft", keep_layers=1))
    return out


@pytest.fixture
def failing_compiler(monkeypatch):
    """torch.compile's inductor backend raising AssertionError("injected") on every graph (compiling for a CPU does
    not fail; on an H200 inductor did, mid-run)."""
    import torch._inductor.compile_fx

    def failing(*args, **kwargs):
        raise AssertionError("injected")

    monkeypatch.setattr(torch._inductor.compile_fx, "compile_fx", failing)


@pytest.fixture(scope="session")
def demo_target_dir():
    """The real demo target, converted once into the user cache (about a minute the first time)."""
    from draftsmith.pipeline.target import convert_gguf, demo_gguf_path

    return convert_gguf(demo_gguf_path(), Path("~/.cache/draftsmith"))


@pytest.fixture(scope="session")
def tiny_chat_target(demo_target_dir, tmp_path_factory):
    """A tiny random Llama on the demo target's tokenizer (vocab 49152): the pipeline's stages run on
    it in seconds, with a real chat template and special tokens."""
    from draftsmith.distill.tokenizer import copy_tokenizer_files

    path = save_tiny_model(tmp_path_factory.mktemp("chat") / "target", "smollm2", seed=3, vocab_size=49152)
    copy_tokenizer_files(demo_target_dir, path)
    import json

    config = json.loads((path / "config.json").read_text())
    config.update(bos_token_id=1, eos_token_id=2, pad_token_id=2)
    (path / "config.json").write_text(json.dumps(config))
    return path


def save_tiny_head(target_dir: Path, path: Path, seed: int, vocab: list[int] | None = None, num_layers: int = 1) -> Path:
    """An EAGLE-3 head for a tiny target, at random (larger-than-default weights, as for the tiny models),
    over `vocab` (default: the whole vocabulary), saved in the speculators format."""
    from draftsmith.distill.eagle import build_head, resolve_aux_layers
    from draftsmith.serve.eagle import save_head
    from draftsmith.serve.weights import read_config

    config = read_config(target_dir)
    vocab = vocab if vocab is not None else list(range(config["vocab_size"]))
    head, layer_config = build_head(target_dir, num_layers, resolve_aux_layers([], config["num_hidden_layers"]), vocab, seed)
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    return save_head(head, path, layer_config, {"name_or_path": str(target_dir), "architectures": ["LlamaForCausalLM"]}, 3)


def wait_ready(url: str, timeout: float = 300, alive=lambda: True) -> None:
    """Poll a server's /ready until it answers 200; fail when `alive()` turns false or the time runs out."""
    import time

    import httpx

    deadline = time.time() + timeout
    while time.time() < deadline:
        assert alive(), "the server stopped before it was ready"
        try:
            if httpx.get(f"{url}/ready").status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    pytest.fail(f"{url} did not become ready in {timeout:.0f} s")
