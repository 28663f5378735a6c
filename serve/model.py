"""Llama-family decoder (Llama, Qwen2, Qwen3, Mistral, SmolLM2) with a static KV cache, in plain PyTorch.

One forward takes `tokens [B, T]` at `positions [B, T]` (each row at its own offset) and returns
`logits [B, T, V]`. Keys and values are written into the cache at those positions, and a query at
position p attends to cache slots 0..p. Rolling a sequence back is therefore just moving its length:
slots past the length are overwritten before anything can attend to them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from draftsmith.serve import decode_attention

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")


class UnsupportedModelError(ValueError):
    """The model's architecture or settings are outside what the runtime implements."""


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
    rope_theta: float
    rope_scaling: tuple[tuple[str, Any], ...]  # rope_type and its parameters, hashable
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    sliding_window: int | None
    qk_norm: bool = False  # Qwen3: an RMSNorm over each head of q and k, before the rotary embedding

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelArgs":
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported by draftsmith's runtime (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        if cfg.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"hidden_act {cfg['hidden_act']!r} is not supported (only silu)")
        heads = cfg["num_attention_heads"]
        # transformers 5 writes rope settings as rope_parameters; older configs as rope_theta + rope_scaling
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "linear", "llama3"):
            raise UnsupportedModelError(f"rope_type {rope_type!r} is not supported (default, linear, llama3)")
        rope["rope_type"] = rope_type
        rope.pop("type", None)
        sliding = cfg.get("sliding_window") if cfg.get("use_sliding_window", model_type == "mistral") else None
        attention_bias = bool(cfg.get("attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=tuple(sorted((k, v) for k, v in rope.items() if not isinstance(v, (list, dict)))),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=attention_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            sliding_window=sliding,
            qk_norm=model_type == "qwen3",
        )


def rope_inv_freq(args: ModelArgs) -> Tensor:
    """Inverse frequencies [head_dim / 2], with linear or Llama-3 scaling applied."""
    dim = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rope = dict(args.rope_scaling)
    if rope["rope_type"] == "linear":
        return inv_freq / rope["factor"]
    if rope["rope_type"] == "llama3":
        factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
        old_len = rope["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


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


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, in_features: int | None = None):
        super().__init__()
        self.args = args
        q_out, kv_out = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
        # q, k, v fused; an EAGLE-3 head's first layer reads 2 x hidden_size (token embedding, hidden state)
        self.wqkv = nn.Linear(in_features or args.hidden_size, q_out + 2 * kv_out, bias=args.qkv_bias)
        self.wo = nn.Linear(q_out, args.hidden_size, bias=args.o_bias)
        self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps) if args.qk_norm else None
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
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v

    def attend(self, q: Tensor, keys: Tensor, values: Tensor, mask: Tensor) -> Tensor:
        """q [B, T, H, D] over keys, values [B, H_kv, S, D] with mask [B or 1, 1, T, S] -> [B, T, hidden]."""
        B, T = q.shape[:2]
        if q.device.type == "cpu" and T > 1:
            y = folded_attention(q.transpose(1, 2), keys, values, mask)
        else:
            y = F.scaled_dot_product_attention(
                q.transpose(1, 2), keys, values, attn_mask=mask, enable_gqa=self.args.num_heads != self.args.num_kv_heads
            )  # [B, H, T, D]
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, rows: Tensor, slots: Tensor, read: Tensor | None = None) -> Tensor:
        q, k, v = self.project(x, cos, sin)
        assert self.cache is not None, "call setup_cache first"
        self.cache.write(rows, slots, k, v)
        B, T = q.shape[:2]
        if USE_DECODE_ATTENTION and decode_attention.runs(q, self.args.num_kv_heads):  # decode steps on a GPU
            y = decode_attention.op(q, self.cache.k, self.cache.v, slots, self.cache.k.shape[2] - 1, read)  # [B, T, H, D]
            return self.wo(y.reshape(B, T, -1))
        keys, values = self.cache.read(B, read)  # [B, H_kv, S, D]
        return self.attend(q, keys, values, mask)


# On a GPU with triton, forwards of a few tokens a row attend with serve/decode_attention.py
USE_DECODE_ATTENTION = True


def folded_attention(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor) -> Tensor:
    """torch's fused attention with each KV head's query heads folded into its query rows (the same
    products; q [B, H, T, D], keys, values [B, H_kv, S, D], mask [B or 1, 1, T, S]). On a CPU its kernel
    with enable_gqa took twice as long over 2-6 query tokens (batch 20, 161 slots: 0.35 against 0.16 ms a
    layer); over one query token they took the same."""
    B, H, T, D = q.shape
    kv_heads = keys.shape[1]
    groups = H // kv_heads
    mask = mask.unsqueeze(2).expand(mask.shape[0], 1, groups, T, mask.shape[-1]).reshape(mask.shape[0], 1, groups * T, -1)
    y = F.scaled_dot_product_attention(q.reshape(B, kv_heads, groups * T, D), keys, values, attn_mask=mask)
    return y.view(B, H, T, D)


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.intermediate = args.intermediate_size
        self.w13 = nn.Linear(args.hidden_size, 2 * args.intermediate_size, bias=args.mlp_bias)  # gate, up fused
        self.w2 = nn.Linear(args.intermediate_size, args.hidden_size, bias=args.mlp_bias)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.w13(x).split(self.intermediate, dim=-1)
        return self.w2(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.feed_forward = FeedForward(args)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, rows: Tensor, slots: Tensor, read: Tensor | None = None) -> Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, mask, rows, slots, read)
        return h + self.feed_forward(self.ffn_norm(h))


@dataclass
class Placement:
    """Where a forward's tokens sit: cache rows and slots [B, T], rope tables [B, T, 1, D] and the
    attention mask [B, 1, T, S] (a query at position p sees slots 0..p)."""

    rows: Tensor
    slots: Tensor
    cos: Tensor
    sin: Tensor
    mask: Tensor
    read: Tensor | None  # the cache rows attended over (None: 0..B-1)


@dataclass
class CacheState:
    """What setup_cache allocates: a KV cache per attention layer and the rotary tables for its slots."""

    caches: list[KVCache]
    rope_cos: Tensor
    rope_sin: Tensor
    slot_ids: Tensor
    max_batch_size: int
    max_seq_len: int


class CachedModel(nn.Module):
    """A stack of attention layers over a static KV cache indexed by position: the target and draft
    decoders (Transformer) and the EAGLE-3 head (serve/eagle.py)."""

    args: ModelArgs
    cache_state: CacheState  # the cache in use (setup_cache, use_cache)

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
        if self.args.sliding_window is not None and max_seq_len > self.args.sliding_window:
            raise UnsupportedModelError(
                f"max_seq_len {max_seq_len} exceeds the model's sliding window "
                f"{self.args.sliding_window}, which the runtime does not implement"
            )
        weight = next(self.parameters())
        slots = max_seq_len + 1
        caches = [
            KVCache(max_batch_size, self.args.num_kv_heads, slots, self.args.head_dim, weight.dtype, weight.device)
            for _ in self.attention_layers()
        ]
        inv_freq = rope_inv_freq(self.args).to(weight.device)
        freqs = torch.outer(torch.arange(slots, device=weight.device, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)  # [S, D]
        state = CacheState(
            caches,
            emb.cos().to(weight.dtype),
            emb.sin().to(weight.dtype),
            torch.arange(slots, device=weight.device),
            max_batch_size,
            max_seq_len,
        )
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
        mask = self.slot_ids.view(1, 1, 1, -1) <= slots.view(B, 1, T, 1)  # [B, 1, T, S]
        mask = mask & (self.slot_ids.view(1, 1, 1, -1) < self.max_seq_len)
        return Placement(
            row_ids.unsqueeze(1).expand(B, T), slots, self.rope_cos[slots].unsqueeze(2), self.rope_sin[slots].unsqueeze(2), mask, cache_rows
        )


class Transformer(CachedModel):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.output = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.fused_block = None  # torch.compile'd _run_block, shared by every layer (see compile_blocks)
        self.vocab: Tensor | None = None  # [V']: the token ids a draft proposes from (see use_vocab)

    def attention_layers(self) -> list[Attention]:
        return [layer.attention for layer in self.layers]

    def compile_blocks(self) -> None:
        """Fuse each block's many small kernels with torch.compile. Every layer runs the same compiled
        code (one compile per input shape), so compiling costs seconds, not a whole-model trace."""
        import torch._dynamo

        # one compile per (batch, tokens) shape: continuous batching uses a few buckets x (K + 1) shapes
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 128)
        self.fused_block = torch.compile(_run_block, fullgraph=True, dynamic=False)

    def use_vocab(self, token_ids: Tensor) -> None:
        """Compute logits over these token ids only (a draft's frequent tokens: a cheaper LM head);
        forward then returns [B, T, V'] in this order."""
        self.vocab = token_ids.to(self.output.weight.device)
        self.vocab_head = self.output.weight[self.vocab].clone()  # [V', hidden]

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
        x = self.tok_embeddings(tokens)  # [B, T, hidden]
        run = self.fused_block if fused and self.fused_block is not None else _run_block
        entering = {}
        for i, layer in enumerate(self.layers):
            if i in hidden_layers:
                entering[i] = x
            x = run(layer, x, at.cos, at.sin, at.mask, at.rows, at.slots, at.read)
        if logits_at is not None:
            x = x.gather(1, logits_at.unsqueeze(-1).expand(-1, -1, x.shape[-1]))  # [B, T', hidden]
        x = self.norm(x)
        logits = self.output(x) if self.vocab is None else F.linear(x, self.vocab_head)  # [B, T or T', V or V']
        return (logits, torch.cat([entering[i] for i in hidden_layers], dim=-1)) if hidden_layers else logits


def _run_block(
    layer: Block, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, rows: Tensor, slots: Tensor, read: Tensor | None = None
) -> Tensor:
    return layer(x, cos, sin, mask, rows, slots, read)
