"""The decoders draftsmith serves (Llama, Qwen2, Qwen3, Mistral, Gemma 2, Gemma 3, Phi-3, SmolLM2) with a
static KV cache, in plain PyTorch.

One forward takes `tokens [B, T]` at `positions [B, T]` (each row at its own offset) and returns
`logits [B, T, V]`. Keys and values are written into the cache at those positions, and a query at
position p attends to cache slots 0..p (a sliding-window layer: p - window + 1..p). Rolling a sequence
back is therefore just moving its length: slots past the length are overwritten before anything can
attend to them.

The families differ in a few settings, all in ModelArgs: Qwen3 and Gemma 3 normalise each head of q and k;
Gemma 2 and 3 scale the embeddings by sqrt(hidden), normalise with (1 + w), add norms after attention and
after the MLP, use GELU (tanh), their own query scaling, alternate sliding-window and global layers (Gemma 3
with another RoPE base for the sliding ones), and Gemma 2 soft-caps attention scores and logits; Phi-3 rotates
part of each head (partial_rotary_factor) and ships fused qkv and gate_up weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from draftsmith.serve import decode_attention, gemv

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text", "phi3")
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")
GEMMA = ("gemma2", "gemma3_text")
Rope = tuple[tuple[str, Any], ...]  # a layer type's RoPE settings (rope_type, rope_theta and its parameters), hashable


class UnsupportedModelError(ValueError):
    """The model's architecture or settings are outside what the runtime implements."""


def hashable(value: Any) -> Any:
    return tuple(hashable(v) for v in value) if isinstance(value, list) else value


def rope_of(cfg: dict[str, Any], layer_type: str = "full_attention") -> Rope:
    """The RoPE settings of a layer type: transformers 5 writes them as rope_parameters (per layer type where
    they differ, as Gemma 3's), older configs as rope_theta and rope_scaling."""
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    if layer_type in rope or "full_attention" in rope:
        rope = dict(rope.get(layer_type) or rope["full_attention"])
    theta = rope.pop("rope_theta", None) or cfg.get("rope_theta", 10000.0)
    if layer_type == "sliding_attention" and cfg.get("rope_local_base_freq"):
        rope, theta = {}, cfg["rope_local_base_freq"]  # Gemma 3 written before rope_parameters
    rope_type = rope.pop("type", None) or rope.get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        raise UnsupportedModelError(f"rope_type {rope_type!r} is not supported ({', '.join(ROPE_TYPES)})")
    rope.update(rope_type=rope_type, rope_theta=float(theta))
    if rope_type == "longrope" and "original_max_position_embeddings" not in rope:
        rope["original_max_position_embeddings"] = cfg.get("original_max_position_embeddings") or cfg["max_position_embeddings"]
    return tuple(sorted((k, hashable(v)) for k, v in rope.items() if not isinstance(v, dict)))


def layer_windows(cfg: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: global attention). layer_types where the config has them; else one
    window for every layer (Mistral, Phi-3) when the config sets one."""
    window = cfg.get("sliding_window")
    if cfg.get("layer_types"):
        return tuple(window if kind == "sliding_attention" else None for kind in cfg["layer_types"][:num_layers])
    if cfg.get("use_sliding_window") is False:
        return (None,) * num_layers
    return (window,) * num_layers


@dataclass(frozen=True)
class ModelArgs:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: Rope  # global layers' RoPE
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    windows: tuple[int | None, ...] = ()  # each layer's sliding window, None: global ("": none anywhere)
    local_rope: Rope | None = None  # sliding layers' RoPE where it differs (Gemma 3)
    partial_rotary: float = 1.0  # the share of each head's dimensions that rotates (Phi-3, Phi-4-mini)
    qk_norm: bool = False  # Qwen3, Gemma 3: an RMSNorm over each head of q and k, before the rotary embedding
    norm_offset: float = 0.0  # Gemma: norms scale by (1 + w)
    embed_scale: float | None = None  # Gemma: embeddings times sqrt(hidden_size)
    activation: str = "silu"  # or gelu_tanh (Gemma)
    sandwich_norm: bool = False  # Gemma 2, 3: norms after attention and after the MLP too
    attn_scale: float | None = None  # the query scaling (Gemma: query_pre_attn_scalar^-0.5); None: head_dim^-0.5
    attn_softcap: float | None = None  # Gemma 2: attention scores softcap x tanh(score / softcap)
    final_softcap: float | None = None  # Gemma 2: the same on the logits

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelArgs":
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported by draftsmith's runtime (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        gemma = model_type in GEMMA
        activation = cfg.get("hidden_activation") or cfg.get("hidden_act", "silu")
        if activation not in ("silu", "gelu_pytorch_tanh"):
            raise UnsupportedModelError(f"hidden activation {activation!r} is not supported (silu, gelu_pytorch_tanh)")
        heads, layers = cfg["num_attention_heads"], cfg["num_hidden_layers"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        windows = layer_windows(cfg, layers)
        local = rope_of(cfg, "sliding_attention") if any(windows) else None
        rope = rope_of(cfg)
        attention_bias = bool(cfg.get("attention_bias", False))
        partial = (cfg.get("rope_parameters") or {}).get("partial_rotary_factor") or cfg.get("partial_rotary_factor", 1.0)
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope=rope,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=attention_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            windows=windows if any(windows) else (),
            local_rope=local if local != rope else None,
            partial_rotary=float(partial),
            qk_norm=model_type in ("qwen3", "gemma3_text"),
            norm_offset=1.0 if gemma else 0.0,
            embed_scale=cfg["hidden_size"] ** 0.5 if gemma else None,
            activation="gelu_tanh" if activation == "gelu_pytorch_tanh" else "silu",
            sandwich_norm=gemma,
            attn_scale=cfg["query_pre_attn_scalar"] ** -0.5 if gemma and cfg.get("query_pre_attn_scalar") else None,
            attn_softcap=cfg.get("attn_logit_softcapping") if gemma else None,
            final_softcap=cfg.get("final_logit_softcapping") if gemma else None,
        )

    def window(self, layer: int) -> int | None:
        return self.windows[layer] if self.windows else None


def runtime_refusal(cfg: dict[str, Any]) -> str | None:
    """Why the runtime cannot run a model of this config.json (its family or settings), or None when it can."""
    try:
        ModelArgs.from_hf_config(cfg)
    except UnsupportedModelError as e:
        return str(e)
    return None


@dataclass(frozen=True)
class ModelShape:
    """A causal LM's shape as its config.json states it, for any family (what an EAGLE-3 head's fit and a
    model run through transformers need; ModelArgs, the runtime's, only for the families it implements)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    max_position_embeddings: int
    tie_word_embeddings: bool

    @classmethod
    def of(cls, cfg: dict[str, Any]) -> "ModelShape":
        text = cfg.get("text_config", cfg)
        return cls(
            cfg["model_type"],
            text["vocab_size"],
            text["hidden_size"],
            text["num_hidden_layers"],
            text.get("max_position_embeddings", 2048),
            bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
        )


def rope_inv_freq(rope: Rope, dim: int, max_position_embeddings: int, seq_len: int | None = None) -> tuple[Tensor, float]:
    """Inverse frequencies [dim / 2] of a RoPE and the factor on cos and sin (yarn's and longrope's
    attention factor, 1 otherwise). seq_len: the longest sequence the tables cover (dynamic NTK scales for it;
    within max_position_embeddings it is the default RoPE, as transformers computes it there)."""
    r = dict(rope)
    base, kind = r["rope_theta"], r["rope_type"]
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    if kind == "dynamic":
        length = max(seq_len or 0, max_position_embeddings)
        base = base * ((r["factor"] * length / max_position_embeddings) - (r["factor"] - 1)) ** (dim / (dim - 2))
    inv_freq = 1.0 / (base**exponents)
    if kind == "linear":
        return inv_freq / r["factor"], 1.0
    if kind == "llama3":
        return llama3_frequencies(inv_freq, r), 1.0
    if kind == "yarn":
        return yarn_frequencies(inv_freq, r, dim, base, max_position_embeddings)
    return inv_freq, 1.0


def llama3_frequencies(inv_freq: Tensor, r: dict[str, Any]) -> Tensor:
    factor, low, high = r["factor"], r["low_freq_factor"], r["high_freq_factor"]
    old_len = r["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def yarn_frequencies(inv_freq: Tensor, r: dict[str, Any], dim: int, base: float, max_position_embeddings: int) -> tuple[Tensor, float]:
    """YaRN: interpolated low frequencies, extrapolated high ones, a linear ramp between, and the attention factor."""
    original = r["original_max_position_embeddings"]
    factor = r.get("factor") or max_position_embeddings / original
    mscale = lambda scale, m=1.0: 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
    attention_factor = r.get("attention_factor")
    if attention_factor is None:
        both = r.get("mscale") and r.get("mscale_all_dim")
        attention_factor = mscale(factor, r["mscale"]) / mscale(factor, r["mscale_all_dim"]) if both else mscale(factor)
    correction = lambda rotations: (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))
    low, high = correction(r.get("beta_fast") or 32), correction(r.get("beta_slow") or 1)
    if r.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / ((high - low) or 0.001)).clamp(0, 1)
    extrapolated = 1 - ramp
    return inv_freq / factor * (1 - extrapolated) + inv_freq * extrapolated, float(attention_factor)


def rotary(rope: Rope, dim: int, max_position_embeddings: int, positions: Tensor, seq_len: int | None = None) -> tuple[Tensor, Tensor]:
    """cos, sin [*positions.shape, dim] (float32) at `positions`. LongRoPE: its short factors below the original
    context, its long ones from there (per position, as vLLM; transformers switches a whole forward at once)."""
    r = dict(rope)
    positions = positions.float().unsqueeze(-1)
    if r["rope_type"] == "longrope":
        original = r["original_max_position_embeddings"]
        factor = r.get("factor") or max_position_embeddings / original
        scale = r.get("attention_factor") or (1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original)))
        base_freq = 1.0 / (r["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        short, long = (base_freq / torch.tensor(r[key], dtype=torch.float32) for key in ("short_factor", "long_factor"))
        freqs = torch.where(positions < original, positions * short.to(positions.device), positions * long.to(positions.device))
    else:
        inv_freq, scale = rope_inv_freq(rope, dim, max_position_embeddings, seq_len)
        freqs = positions * inv_freq.to(positions.device)  # [..., dim / 2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scale, emb.sin() * scale


def rope_tables(rope: Rope, dim: int, max_position_embeddings: int, slots: int, device, dtype) -> tuple[Tensor, Tensor]:
    """cos, sin [slots, dim] of positions 0..slots-1, in `dtype`."""
    cos, sin = rotary(rope, dim, max_position_embeddings, torch.arange(slots, device=device), slots)
    return cos.to(dtype), sin.to(dtype)


class RMSNorm(nn.Module):
    """x / rms(x), times w (Llama) or, offset 1, times (1 + w) in float32 (Gemma)."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.ones(dim) if not offset else torch.zeros(dim))

    def forward(self, x: Tensor) -> Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (h * (self.offset + self.weight.float())).to(x.dtype)
        return self.weight * h.to(x.dtype)


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """The rotary embedding over the first cos.shape[-1] dims of each head (all of them but for partial rotary)."""
    d = cos.shape[-1]
    if d == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    turned, rest = x[..., :d], x[..., d:]
    return torch.cat([turned * cos + rotate_half(turned) * sin, rest], dim=-1)


class KVCache(nn.Module):
    """Keys and values of one layer: [B, H_kv, S, D] each, written at each row's positions."""

    def __init__(self, batch: int, num_kv_heads: int, slots: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        shape = (batch, num_kv_heads, slots, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def write(self, rows: Tensor, slots: Tensor, k: Tensor, v: Tensor) -> None:
        # rows, slots: [B, T]; k, v: [B, T, H_kv, D]
        self.k[rows, :, slots] = k
        self.v[rows, :, slots] = v

    def read(self, batch: int, read: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Keys and values of the rows attended over: `read` [B] (None: 0..batch-1)."""
        if read is None:
            return self.k[:batch], self.v[:batch]
        return self.k[read], self.v[read]


# On a GPU with triton, one sequence's products (a step at batch 1) read weights of at least gemv.MIN_WEIGHT elements
# with serve/gemv.py: at the Llama-3.1-8B shape a plain step 6.06 ms against cuBLAS's 6.33, at the demo target's as
# fast as cuBLAS, greedy output equal to plain decoding's (H100, 2026-12-06, benchmarks/RESULTS.md)
USE_GEMV = True


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, residual: Tensor | None = None) -> Tensor:
    """F.linear (plus residual), through serve/gemv.py where it runs (USE_GEMV; no gradient through it), the residual
    added in its kernel: one kernel a layer fewer, at the 8B shapes 0.5% off a step (H100, 2026-12-07)."""
    if USE_GEMV and gemv.runs(x, weight) and not (torch.is_grad_enabled() and weight.requires_grad):
        return gemv.op(x, weight, bias, residual)
    out = F.linear(x, weight, bias)
    return out if residual is None else residual + out


class Linear(nn.Linear):
    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, in_features: int | None = None, window: int | None = None):
        super().__init__()
        self.args, self.window = args, window  # window: this layer's sliding window (None: global attention)
        self.scale = args.attn_scale or args.head_dim**-0.5
        q_out, kv_out = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
        # q, k, v fused; an EAGLE-3 head's first layer reads 2 x hidden_size (token embedding, hidden state)
        self.wqkv = Linear(in_features or args.hidden_size, q_out + 2 * kv_out, bias=args.qkv_bias)
        self.wo = Linear(q_out, args.hidden_size, bias=args.o_bias)
        self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps, args.norm_offset) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps, args.norm_offset) if args.qk_norm else None
        self.cache: KVCache | None = None

    def project(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q [B, T, H, D], and k, v [B, T, H_kv, D], rotated."""
        B, T, _ = x.shape
        a = self.args
        q_out, kv_out = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        q, k, v = self.wqkv(x).split([q_out, kv_out, kv_out], dim=-1)
        q = q.view(B, T, a.num_heads, a.head_dim)
        k = k.view(B, T, a.num_kv_heads, a.head_dim)
        v = v.view(B, T, a.num_kv_heads, a.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return rotate(q, cos, sin), rotate(k, cos, sin), v

    def attend(self, q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, residual: Tensor | None = None) -> Tensor:
        """q [B, T, H, D] over keys, values [B, H_kv, S, D] with mask [B or 1, 1, T, S] -> [B, T, hidden] (plus
        residual)."""
        B, T = q.shape[:2]
        if self.args.attn_softcap:
            y = softcapped_attention(q.transpose(1, 2), keys, values, mask, self.scale, self.args.attn_softcap)
        elif q.device.type == "cpu":
            y = folded_attention(q.transpose(1, 2), keys, values, mask, self.scale)
        else:
            gqa = self.args.num_heads != self.args.num_kv_heads
            y = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask, scale=self.scale, enable_gqa=gqa)
        return linear(y.transpose(1, 2).reshape(B, T, -1), self.wo.weight, self.wo.bias, residual)  # y [B, H, T, D]

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor,
        rows: Tensor,
        slots: Tensor,
        read: Tensor | None = None,
        residual: Tensor | None = None,
    ) -> Tensor:
        """Attention over x, plus residual."""
        q, k, v = self.project(x, cos, sin)
        assert self.cache is not None, "call setup_cache first"
        self.cache.write(rows, slots, k, v)
        B, T = q.shape[:2]
        if USE_DECODE_ATTENTION and decode_attention.runs(q, self.args.num_kv_heads):  # decode steps on a GPU
            last = self.cache.k.shape[2] - 1
            softcap = self.args.attn_softcap or 0.0
            y = decode_attention.op(q, self.cache.k, self.cache.v, slots, last, read, self.window or 0, softcap, self.scale)  # [B, T, H, D]
            return linear(y.reshape(B, T, -1), self.wo.weight, self.wo.bias, residual)
        keys, values = self.cache.read(B, read)  # [B, H_kv, S, D]
        return self.attend(q, keys, values, mask, residual)


# On a GPU with triton, forwards of a few tokens a row attend with serve/decode_attention.py
USE_DECODE_ATTENTION = True


def folded_attention(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, scale: float) -> Tensor:
    """torch's fused attention with each KV head's query heads folded into its query rows (the same
    products; q [B, H, T, D], keys, values [B, H_kv, S, D], mask [B or 1, 1, T, S]). On a CPU its kernel
    with enable_gqa took twice as long over 2-6 query tokens (batch 20, 161 slots: 0.35 against 0.16 ms a
    layer), and in bfloat16 over one query token 4.5x as long: the demo target's plain step at batch 16 took
    111.8 ms against 38.7 ms folded, more than a step over two tokens (47.7 ms)."""
    B, H, T, D = q.shape
    kv_heads = keys.shape[1]
    groups = H // kv_heads
    mask = mask.unsqueeze(2).expand(mask.shape[0], 1, groups, T, mask.shape[-1]).reshape(mask.shape[0], 1, groups * T, -1)
    y = F.scaled_dot_product_attention(q.reshape(B, kv_heads, groups * T, D), keys, values, attn_mask=mask, scale=scale)
    return y.view(B, H, T, D)


def softcapped_attention(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, scale: float, softcap: float) -> Tensor:
    """Attention whose scores are soft-capped before the softmax (Gemma 2), written out: q [B, H, T, D],
    keys, values [B, H_kv, S, D], mask [B or 1, 1, T, S] -> [B, H, T, D]."""
    B, H, T, D = q.shape
    groups = H // keys.shape[1]
    keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
    scores = (q.float() @ keys.float().transpose(-1, -2)) * scale  # [B, H, T, S]
    scores = (torch.tanh(scores / softcap) * softcap).masked_fill(~mask, float("-inf"))
    return (scores.softmax(-1) @ values.float()).to(q.dtype)


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.intermediate, self.activation = args.intermediate_size, args.activation
        self.w13 = Linear(args.hidden_size, 2 * args.intermediate_size, bias=args.mlp_bias)  # gate, up fused
        self.w2 = Linear(args.intermediate_size, args.hidden_size, bias=args.mlp_bias)

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        gate, up = self.w13(x).split(self.intermediate, dim=-1)
        act = F.gelu(gate, approximate="tanh") if self.activation == "gelu_tanh" else F.silu(gate)
        return linear(act * up, self.w2.weight, self.w2.bias, residual)


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer: int = 0):
        super().__init__()
        norm = lambda: RMSNorm(args.hidden_size, args.rms_norm_eps, args.norm_offset)
        self.attention_norm, self.ffn_norm = norm(), norm()
        self.attention = Attention(args, window=args.window(layer))
        self.feed_forward = FeedForward(args)
        # Gemma 2 and 3 normalise each sublayer's output too, before the residual add
        self.post_attention_norm, self.post_ffn_norm = (norm(), norm()) if args.sandwich_norm else (None, None)

    @property
    def sliding(self) -> bool:
        return self.attention.window is not None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, rows: Tensor, slots: Tensor, read: Tensor | None = None) -> Tensor:
        if self.post_attention_norm is None:  # each residual add in the kernel of the product before it, where it can
            h = self.attention(self.attention_norm(x), cos, sin, mask, rows, slots, read, x)
            return self.feed_forward(self.ffn_norm(h), h)
        h = x + self.post_attention_norm(self.attention(self.attention_norm(x), cos, sin, mask, rows, slots, read))
        return h + self.post_ffn_norm(self.feed_forward(self.ffn_norm(h)))


@dataclass
class Placement:
    """Where a forward's tokens sit: cache rows and slots [B, T], rope tables [B, T, 1, D] and the
    attention mask [B, 1, T, S] (a query at position p sees slots 0..p); for sliding-window layers their own
    rope tables (where they differ) and mask (slots p - window + 1..p)."""

    rows: Tensor
    slots: Tensor
    cos: Tensor
    sin: Tensor
    mask: Tensor
    read: Tensor | None  # the cache rows attended over (None: 0..B-1)
    local_cos: Tensor | None = None
    local_sin: Tensor | None = None
    local_mask: Tensor | None = None

    def of(self, block: "Block") -> tuple[Tensor, Tensor, Tensor]:
        """cos, sin and mask of a block's layer."""
        if not block.sliding:
            return self.cos, self.sin, self.mask
        return (
            (self.cos if self.local_cos is None else self.local_cos),
            (self.sin if self.local_sin is None else self.local_sin),
            self.local_mask,
        )


@dataclass
class CacheState:
    """What setup_cache allocates: a KV cache per attention layer and the rotary tables for its slots."""

    caches: list[KVCache]
    rope_cos: Tensor
    rope_sin: Tensor
    slot_ids: Tensor
    max_batch_size: int
    max_seq_len: int
    local_cos: Tensor | None = None  # sliding layers' tables where their RoPE differs (Gemma 3)
    local_sin: Tensor | None = None


class CachedModel(nn.Module):
    """A stack of attention layers over a static KV cache indexed by position: the target and draft
    decoders (Transformer) and the EAGLE-3 head (serve/eagle.py)."""

    args: ModelArgs
    cache_state: CacheState  # the cache in use (setup_cache, use_cache)
    graphable = True  # its forwards can be captured as CUDA graphs and compiled

    @property
    def max_batch_size(self) -> int:
        return self.cache_state.max_batch_size

    @property
    def max_seq_len(self) -> int:
        return self.cache_state.max_seq_len

    def attention_layers(self) -> list[Attention]:
        raise NotImplementedError

    def setup_cache(self, max_batch_size: int, max_seq_len: int) -> "CacheState":
        """Allocate the static KV cache and put it in use. One spare slot takes the writes of padding positions."""
        weight, a = next(self.parameters()), self.args
        slots = max_seq_len + 1
        caches = [KVCache(max_batch_size, a.num_kv_heads, slots, a.head_dim, weight.dtype, weight.device) for _ in self.attention_layers()]
        tables = lambda rope: rope_tables(rope, a.rotary_dim, a.max_position_embeddings, slots, weight.device, weight.dtype)
        cos, sin = tables(a.rope)
        local = tables(a.local_rope) if a.local_rope is not None else (None, None)
        state = CacheState(caches, cos, sin, torch.arange(slots, device=weight.device), max_batch_size, max_seq_len, *local)
        self.use_cache(state)
        return state

    def use_cache(self, state: "CacheState") -> None:
        """Put `state` (from this model's setup_cache) in use, if it is not already: engines sharing a model
        each keep their own cache, which their CUDA graphs were captured on, and take it back before they run."""
        if getattr(self, "cache_state", None) is state:
            return
        for attention, cache in zip(self.attention_layers(), state.caches, strict=True):
            attention.cache = cache
        self.register_buffer("rope_cos", state.rope_cos, persistent=False)
        self.register_buffer("rope_sin", state.rope_sin, persistent=False)
        self.register_buffer("slot_ids", state.slot_ids, persistent=False)
        self.cache_state = state

    def place(self, positions: Tensor, cache_rows: Tensor | None = None) -> Placement:
        # positions [B, T]; positions past max_seq_len are padding. cache_rows [B]: the KV cache rows of
        # the B sequences (None: rows 0..B-1); the scheduler prefills a joining request into its own row
        B, T = positions.shape
        slots = positions.clamp(max=self.max_seq_len)  # padding writes land in the spare slot
        row_ids = torch.arange(B, device=positions.device) if cache_rows is None else cache_rows
        ids = self.slot_ids.view(1, 1, 1, -1)
        mask = (ids <= slots.view(B, 1, T, 1)) & (ids < self.max_seq_len)  # [B, 1, T, S]
        at = Placement(
            row_ids.unsqueeze(1).expand(B, T), slots, self.rope_cos[slots].unsqueeze(2), self.rope_sin[slots].unsqueeze(2), mask, cache_rows
        )
        if window := next((w for w in self.args.windows if w), None):  # sliding layers: the last `window` slots only
            at.local_mask = mask & (ids > (slots - window).view(B, 1, T, 1))
            if self.cache_state.local_cos is not None:
                at.local_cos = self.cache_state.local_cos[slots].unsqueeze(2)
                at.local_sin = self.cache_state.local_sin[slots].unsqueeze(2)
        return at


class Transformer(CachedModel):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(Block(args, i) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, args.norm_offset)
        self.output = Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.fused_block = None  # torch.compile'd _run_block, shared by every layer (see compile_blocks)
        self.vocab: Tensor | None = None  # [V']: the token ids a draft proposes from (see use_vocab)

    def attention_layers(self) -> list[Attention]:
        return [layer.attention for layer in self.layers]

    def compile_blocks(self) -> None:
        """Fuse each block's many small kernels with torch.compile. Every layer runs the same compiled
        code (one compile per input shape, and per kind of layer), so compiling costs seconds, not a
        whole-model trace."""
        import torch._dynamo

        # one compile per (batch, tokens) shape: continuous batching uses a few buckets x (K + 1) shapes
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 128)
        self.fused_block = torch.compile(_run_block, fullgraph=True, dynamic=False)

    def use_vocab(self, token_ids: Tensor) -> None:
        """Compute logits over these token ids only (a draft's frequent tokens: a cheaper LM head);
        forward then returns [B, T, V'] in this order."""
        self.vocab = token_ids.to(self.output.weight.device)
        self.vocab_head = self.output.weight[self.vocab].clone()  # [V', hidden]

    def embed(self, tokens: Tensor) -> Tensor:
        """The token embeddings [B, T, hidden] the first layer reads (Gemma: times sqrt(hidden), in their dtype)."""
        x = self.tok_embeddings(tokens)
        return x if self.args.embed_scale is None else x * torch.tensor(self.args.embed_scale, dtype=x.dtype)

    def forward(
        self,
        tokens: Tensor,
        positions: Tensor,
        fused: bool = False,
        logits_at: Tensor | None = None,
        cache_rows: Tensor | None = None,
        hidden_layers: tuple[int, ...] = (),
    ) -> Tensor | tuple[Tensor, Tensor]:
        # tokens, positions: [B, T] with B <= max_batch_size; positions past max_seq_len are padding.
        # fused: run the compiled blocks (fixed decode shapes only: each new shape compiles again).
        # logits_at [B, T']: indices into T whose logits are wanted (prefill needs only the last one)
        # hidden_layers: also return the hidden states entering these layers, concatenated [B, T, n * hidden]
        # (what an EAGLE-3 head reads; vLLM's aux hidden state layer ids mean the same)
        at = self.place(positions, cache_rows)
        x = self.embed(tokens)  # [B, T, hidden]
        run = self.fused_block if fused and self.fused_block is not None else _run_block
        entering = {}
        for i, layer in enumerate(self.layers):
            if i in hidden_layers:
                entering[i] = x
            x = run(layer, x, *at.of(layer), at.rows, at.slots, at.read)
        if logits_at is not None:
            x = x.gather(1, logits_at.unsqueeze(-1).expand(-1, -1, x.shape[-1]))  # [B, T', hidden]
        x = self.norm(x)
        logits = self.output(x) if self.vocab is None else linear(x, self.vocab_head)  # [B, T or T', V or V']
        if self.args.final_softcap:
            logits = torch.tanh(logits / self.args.final_softcap) * self.args.final_softcap
        return (logits, torch.cat([entering[i] for i in hidden_layers], dim=-1)) if hidden_layers else logits


def _run_block(
    layer: Block, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, rows: Tensor, slots: Tensor, read: Tensor | None = None
) -> Tensor:
    return layer(x, cos, sin, mask, rows, slots, read)
