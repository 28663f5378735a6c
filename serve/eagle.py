"""EAGLE-3 draft heads (Li et al. 2025), in the speculators checkpoint format that vLLM's `eagle3` method loads.

A head reads the target's hidden states entering three of its layers (vLLM's "aux hidden state layer
ids"; by default an early, a middle and a late one), fuses them with `fc` into one hidden state, and
runs it with the embedding of the next token through one decoder layer (more are possible) whose
attention reads [embedding, hidden], then a norm and an LM head over a reduced draft vocabulary whose
entries map onto target token ids.

The head's entry at position t reads the token at t + 1 and a hidden state for position t: the
target's (fused) where the target has read position t, else the head's own output for position t - 1
(its output before the final norm). It predicts the token at t + 2. So after the target verifies a
step, the head catches up on the positions the target read (their features are now known) and the
entry of the last accepted position yields the next step's first proposal; further proposals run on
the head's own hidden states. Training unrolls the same way (distill/eagle.py).

Checkpoint (a directory): config.json with `speculators_model_type: eagle3`, the layer config
(`transformer_layer_config`, a Llama config), `draft_vocab_size`, `target_hidden_size`,
`eagle_aux_hidden_state_layer_ids`, `norm_before_residual` and `speculators_config` (the proposal
method with its speculative_tokens, and the verifier's name and architecture); model.safetensors with
`fc.weight`, `layers.N.*` (HF Llama names; layer 0's q/k/v read 2 x hidden_size, plus `hidden_norm`),
`norm.weight`, `lm_head.weight` [draft vocab, hidden], `d2t` (draft id -> target id minus the draft
id, int64) and `t2d` (target ids in the draft vocabulary, bool). The token embedding is the target's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from draftsmith.serve.model import Attention, CachedModel, FeedForward, ModelArgs, ModelShape, RMSNorm, UnsupportedModelError, rotary

MODEL_TYPE = "eagle3"
SPECULATORS_VERSION = "0.9.0"  # the version of the speculators format these files follow


class EagleFormatError(ValueError):
    """A directory that is not an EAGLE-3 head in the speculators format, or one that does not fit the target."""


def is_eagle_dir(path: Path) -> bool:
    config = Path(path) / "config.json"
    try:
        return config.is_file() and json.loads(config.read_text()).get("speculators_model_type") == MODEL_TYPE
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        return False  # not a readable config: not a head (verify says what is wrong with it)


def default_aux_layers(num_target_layers: int) -> tuple[int, ...]:
    """An early, a middle and a late layer: vLLM's default (2, n / 2, n - 3) for heads that name none;
    the first, middle and last for targets too shallow for that."""
    n = num_target_layers
    return (2, n // 2, n - 3) if n >= 8 else tuple(sorted({0, n // 2, n - 1}))


@dataclass(frozen=True)
class HeadShape:
    aux_layers: tuple[int, ...]  # target layers whose entering hidden states the head reads
    target_hidden_size: int
    draft_vocab_size: int
    norm_before_residual: bool = True


class EagleLayer(nn.Module):
    def __init__(self, args: ModelArgs, first: bool, norm_before_residual: bool):
        super().__init__()
        self.norm_before_residual = norm_before_residual
        self.attention_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)  # the embedding's norm in layer 0
        self.hidden_norm = RMSNorm(args.hidden_size, args.rms_norm_eps) if first else None
        self.attention = Attention(args, in_features=2 * args.hidden_size if first else None)
        self.ffn_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.feed_forward = FeedForward(args)

    def attention_input(self, h: Tensor, embeds: Tensor) -> tuple[Tensor, Tensor]:
        """(what attention reads, the residual): layer 0 reads [norm(embedding), norm(hidden)]."""
        if self.hidden_norm is None:
            return self.attention_norm(h), h
        normed = self.hidden_norm(h)
        return torch.cat([self.attention_norm(embeds), normed], dim=-1), normed if self.norm_before_residual else h

    def forward(
        self, h: Tensor, embeds: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, rows: Tensor, slots: Tensor, read: Tensor | None = None
    ) -> Tensor:
        x, residual = self.attention_input(h, embeds)
        h = residual + self.attention(x, cos, sin, mask, rows, slots, read)
        return h + self.feed_forward(self.ffn_norm(h))

    def unrolled(self, h: Tensor, embeds: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, cache: list[tuple[Tensor, Tensor]]) -> Tensor:
        """One training-time-test step over whole sequences [B, E, hidden]: the keys and values of the
        earlier steps are in `cache` (this step's are appended); `mask` (ttt_mask) says which each entry sees."""
        x, residual = self.attention_input(h, embeds)
        q, k, v = self.attention.project(x, cos, sin)
        cache.append((k.transpose(1, 2), v.transpose(1, 2)))  # [B, H_kv, E, D]
        keys, values = (torch.cat(parts, dim=2) for parts in zip(*cache))
        h = residual + _attend_eagerly(self.attention, q, keys, values, mask)
        return h + self.feed_forward(self.ffn_norm(h))

    def windowed(
        self,
        h: Tensor,
        embeds: Tensor,
        cos: Tensor,
        sin: Tensor,
        entries: Tensor,
        first: tuple[Tensor, Tensor],
        own: list[tuple[Tensor, Tensor]],
        flex: bool = False,
    ) -> Tensor:
        """A training-time-test step after the first over a window of entries [B, W, hidden]: entry `entries` [B, W]
        attends to the first step's keys and values up to it (`first`, [B, H_kv, E, D]) and to its own at the
        steps since (`own`, this step's appended): the keys unrolled() would let through, and no others. flex:
        through flex_window_attention, else window_attention."""
        x, residual = self.attention_input(h, embeds)
        q, k, v = self.attention.project(x, cos, sin)
        own.append((k, v))  # [B, W, H_kv, D]
        own_keys, own_values = (torch.stack(parts, dim=2) for parts in zip(*own))  # [B, W, j, H_kv, D]
        attend = flex_window_attention if flex else window_attention
        h = residual + attend(self.attention, q, *first, entries, own_keys, own_values)
        return h + self.feed_forward(self.ffn_norm(h))


@torch.compiler.disable
def _attend_eagerly(attention: Attention, q: Tensor, keys: Tensor, values: Tensor, mask: Tensor) -> Tensor:
    """Attention over whole sequences (the first step's, and every step's in the whole unroll), outside compiled code:
    with it inside a compiled unroll, inductor stopped on an AssertionError on an H200 (torch 2.11, dynamic shapes),
    once with SDPA and a mask, once written out (2026-12-06). The later steps' window_attention compiles."""
    return attention.attend(q, keys, values, mask)


def window_attention(
    attention: Attention, q: Tensor, keys: Tensor, values: Tensor, entries: Tensor, own_keys: Tensor, own_values: Tensor
) -> Tensor:
    """Training-time test's attention at a step j >= 1, written out: q [B, W, H, D] at entries [B, W] over the first
    step's keys, values [B, H_kv, E, D] up to the query's entry, and over its own entry's at steps 1..j
    (own_keys, own_values [B, W, j, H_kv, D]), one softmax over both: E + j scores a query, where a mask over
    every step's whole keys gives (j + 1) E. -> [B, W, hidden]."""
    B, W, H, D = q.shape
    kv_heads, E = keys.shape[1], keys.shape[2]
    q = q.view(B, W, kv_heads, H // kv_heads, D)  # query head h reads KV head h // groups
    scores = torch.cat([torch.einsum("bwkgd,bkud->bkgwu", q, keys), torch.einsum("bwkgd,bwjkd->bkgwj", q, own_keys)], dim=-1)
    scores = scores.float() * attention.scale
    if attention.args.attn_softcap:
        scores = torch.tanh(scores / attention.args.attn_softcap) * attention.args.attn_softcap
    unseen = torch.arange(E, device=q.device) > entries.unsqueeze(-1)  # [B, W, E]: the first step's keys past the entry
    p = scores.masked_fill(F.pad(unseen, (0, own_keys.shape[2]))[:, None, None], float("-inf")).softmax(-1).to(values.dtype)
    y = torch.einsum("bkgwu,bkud->bwkgd", p[..., :E], values) + torch.einsum("bkgwj,bwjkd->bwkgd", p[..., E:], own_values)
    return attention.wo(y.reshape(B, W, H * D))


def flex_window_attention(
    attention: Attention, q: Tensor, keys: Tensor, values: Tensor, entries: Tensor, own_keys: Tensor, own_values: Tensor
) -> Tensor:
    """window_attention through FlexAttention, which never writes the scores out and skips blocks of keys that no
    query of a block reads: step 0's keys and the window's own (entry-major) side by side, [E | W x j], under a mask
    that lets entry w read step 0's up to `entries[b, w]` and its own j. Training on CUDA only: FlexAttention has
    no backward on a CPU."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    B, W, H, D = q.shape
    kv_heads, E, j = keys.shape[1], keys.shape[2], own_keys.shape[2]
    side_by_side = lambda first, own: torch.cat([first, own.permute(0, 3, 1, 2, 4).reshape(B, kv_heads, W * j, D)], dim=2)
    visible = lambda b, h, w, u: torch.where(u < E, u <= entries[b, w], (u - E) // j == w)
    cap = attention.args.attn_softcap
    capped = (lambda score, b, h, w, u: torch.tanh(score / cap) * cap) if cap else None
    mask = create_block_mask(visible, B, None, W, E + W * j, device=q.device)
    y = flex_attention(
        q.transpose(1, 2),
        side_by_side(keys, own_keys),
        side_by_side(values, own_values),
        score_mod=capped,
        block_mask=mask,
        scale=attention.scale,
        enable_gqa=kv_heads != H,
    )
    return attention.wo(y.transpose(1, 2).reshape(B, W, H * D))


class EagleHead(CachedModel):
    def __init__(self, args: ModelArgs, shape: HeadShape):
        super().__init__()
        self.args, self.shape = args, shape
        self.fc = nn.Linear(len(shape.aux_layers) * shape.target_hidden_size, args.hidden_size, bias=False)
        self.layers = nn.ModuleList(EagleLayer(args, i == 0, shape.norm_before_residual) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = nn.Linear(args.hidden_size, shape.draft_vocab_size, bias=False)
        self.register_buffer("vocab", torch.arange(shape.draft_vocab_size), persistent=False)  # draft id -> target id
        self.fused_layers = None

    @property
    def aux_layers(self) -> tuple[int, ...]:
        return self.shape.aux_layers

    def attention_layers(self) -> list[Attention]:
        return [layer.attention for layer in self.layers]

    def compile_layers(self) -> None:
        """torch.compile the decoder layers (fixed shapes: a decode step's 1 and K+1 tokens)."""
        import torch._dynamo

        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 128)
        self.fused_layers = torch.compile(_run_layers, fullgraph=True, dynamic=False)

    def forward(self, embeds: Tensor, hidden: Tensor, positions: Tensor, fused: bool = False, cache_rows: Tensor | None = None) -> Tensor:
        """embeds, hidden [B, T, hidden] at positions [B, T] -> the head's hidden states [B, T, hidden]
        (before the final norm: what the next entry reads, and what `logits` turns into proposals)."""
        at = self.place(positions, cache_rows)
        run = self.fused_layers if fused and self.fused_layers is not None else _run_layers
        return run(self.layers, hidden, embeds, at.cos, at.sin, at.mask, at.rows, at.slots, at.read)

    def logits(self, hidden: Tensor) -> Tensor:
        """[..., hidden] -> logits over the draft vocabulary [..., V_draft] (entries map to self.vocab)."""
        return self.lm_head(self.norm(hidden))

    def unroll(self, tokens: Tensor, features: Tensor, embeddings: nn.Module, steps: int) -> Iterator[Tensor]:
        """Training-time test over whole sequences, no cache: tokens [B, S] with the target's hidden states
        at each position features [B, S, F]; yields the hidden states [B, E = S - 1, hidden] of step 0, 1,
        ..., steps - 1. Step j's entry t stands for position t + j: it reads the token at t + j + 1 (the
        data's: a draft is only continued where the earlier ones were accepted) and its own step j - 1
        output, and attends to step 0's entries up to t and to its own earlier steps, exactly what an
        inference step's cache holds; it predicts the token at t + j + 2. Training runs the steps after the
        first only where a loss reads them (later_steps())."""
        hidden, first = self.first_step(tokens, features, embeddings)
        yield hidden
        E = tokens.shape[1] - 1
        positions = torch.arange(E, device=tokens.device).unsqueeze(0)
        caches = [[kv] for kv in first]
        for j in range(1, steps):
            embeds = embeddings(F.pad(tokens[:, j + 1 :], (0, j))).to(hidden.dtype)  # [B, E]: the token at t + j + 1
            cos, sin = rope_at(self.args, positions + j, hidden.dtype)
            mask = ttt_mask(E, j, tokens.device)
            for layer, cache in zip(self.layers, caches):
                hidden = layer.unrolled(hidden, embeds, cos, sin, mask, cache)
            yield hidden

    def first_step(self, tokens: Tensor, features: Tensor, embeddings: nn.Module) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:
        """Training-time test's step 0 at every entry: its hidden states [B, E, hidden] and each layer's keys and
        values [B, H_kv, E, D], which every later step attends to."""
        E = tokens.shape[1] - 1
        hidden = self.fc(features[:, :E])
        embeds = embeddings(tokens[:, 1:]).to(hidden.dtype)  # [B, E]: the token at t + 1
        cos, sin = rope_at(self.args, torch.arange(E, device=tokens.device).unsqueeze(0), hidden.dtype)
        mask = ttt_mask(E, 0, tokens.device)
        caches: list[list[tuple[Tensor, Tensor]]] = [[] for _ in self.layers]
        for layer, cache in zip(self.layers, caches):
            hidden = layer.unrolled(hidden, embeds, cos, sin, mask, cache)
        return hidden, [cache[0] for cache in caches]

    def later_steps(
        self,
        hidden: Tensor,
        first: list[tuple[Tensor, Tensor]],
        tokens: Tensor,
        embeddings: nn.Module,
        steps: int,
        window: Tensor,
        flex: bool = False,
    ) -> Iterator[Tensor]:
        """Training-time test's steps 1 .. steps - 1 from step 0's hidden states [B, E, hidden] and keys and values
        (`first`), run only at each row's window of entries [B, W] and yielding [B, W, hidden]: an entry's value at
        a step depends only on its own at the steps before and on step 0's. flex: attention through
        flex_window_attention."""
        E = tokens.shape[1] - 1
        hidden = hidden.gather(1, window.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))
        owns: list[list[tuple[Tensor, Tensor]]] = [[] for _ in self.layers]
        for j in range(1, steps):
            embeds = embeddings(tokens.gather(1, (window + j + 1).clamp(max=E))).to(hidden.dtype)
            cos, sin = rope_at(self.args, window + j, hidden.dtype)
            for layer, kv, own in zip(self.layers, first, owns):
                hidden = layer.windowed(hidden, embeds, cos, sin, window, kv, own, flex)
            yield hidden


def _run_layers(
    layers: nn.ModuleList,
    h: Tensor,
    embeds: Tensor,
    cos: Tensor,
    sin: Tensor,
    mask: Tensor,
    rows: Tensor,
    slots: Tensor,
    read: Tensor | None = None,
) -> Tensor:
    for layer in layers:
        h = layer(h, embeds, cos, sin, mask, rows, slots, read)
    return h


def ttt_mask(entries: int, step: int, device: torch.device) -> Tensor:
    """[1, 1, E, (step + 1) E]: step 0's entries causally, then each earlier step's entry of the same index."""
    causal = torch.ones(entries, entries, dtype=torch.bool, device=device).tril()
    diagonal = torch.eye(entries, dtype=torch.bool, device=device)
    return torch.cat([causal] + [diagonal] * step, dim=1).view(1, 1, entries, -1)


def rope_at(args: ModelArgs, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos, sin [B, T, 1, D] at arbitrary positions [B, T] (training has no static cache tables)."""
    cos, sin = rotary(args.rope, args.rotary_dim, args.max_position_embeddings, positions)
    return cos.to(dtype).unsqueeze(2), sin.to(dtype).unsqueeze(2)


# -- the speculators format --------------------------------------------------------------------------

_RUNTIME_NAMES = {
    "attention_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "hidden_norm": "hidden_norm",
    "attention.wo": "self_attn.o_proj",
    "feed_forward.w2": "mlp.down_proj",
}


def to_checkpoint(head: EagleHead) -> dict[str, Tensor]:
    """The head's weights under the speculators / vLLM names, with d2t and t2d."""
    a = head.args
    q_out, kv_out = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    out = {"fc.weight": head.fc.weight, "norm.weight": head.norm.weight, "lm_head.weight": head.lm_head.weight}
    for i, layer in enumerate(head.layers):
        p = f"layers.{i}."
        for ours, theirs in _RUNTIME_NAMES.items():
            if ours != "hidden_norm" or layer.hidden_norm is not None:
                out[p + theirs + ".weight"] = layer.get_submodule(ours).weight
        q, k, v = layer.attention.wqkv.weight.split([q_out, kv_out, kv_out])
        out.update({p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k, p + "self_attn.v_proj.weight": v})
        gate, up = layer.feed_forward.w13.weight.split(a.intermediate_size)
        out.update({p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up})
    out = {name: t.detach().to(torch.bfloat16).contiguous().cpu() for name, t in out.items()}
    vocab = head.vocab.cpu()
    out["d2t"] = (vocab - torch.arange(len(vocab))).to(torch.int64)
    t2d = torch.zeros(a.vocab_size, dtype=torch.bool)
    t2d[vocab] = True
    out["t2d"] = t2d
    return out


def head_config(head: EagleHead, layer_config: dict[str, Any], verifier: dict[str, Any], num_speculative_tokens: int) -> dict:
    """config.json of the head. verifier: {"name_or_path": ..., "architectures": [...]}."""
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": MODEL_TYPE,
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": MODEL_TYPE,
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {"proposal_type": "greedy", "speculative_tokens": num_speculative_tokens, "verifier_accept_k": 1, "accept_tolerance": 0.0}
            ],
            "verifier": verifier,
        },
        "transformer_layer_config": layer_config,
        "draft_vocab_size": head.shape.draft_vocab_size,
        "target_hidden_size": head.shape.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(head.aux_layers),
        "norm_before_residual": head.shape.norm_before_residual,
        "dtype": "bfloat16",
    }


def layer_config_of(target_config: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """The head's decoder-layer config: the target's attention and MLP shape, as a Llama config."""
    keep = (
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "rope_theta",
        "rope_scaling",
        "rope_parameters",
        "max_position_embeddings",
        "vocab_size",
        "hidden_act",
        "attention_bias",
        "mlp_bias",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
    )
    config = {key: target_config[key] for key in keep if target_config.get(key) is not None}
    config.setdefault("head_dim", target_config["hidden_size"] // target_config["num_attention_heads"])
    return {
        **config,
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "num_hidden_layers": num_layers,
        "tie_word_embeddings": False,
    }


def save_head(head: EagleHead, out_dir: Path, layer_config: dict[str, Any], verifier: dict[str, Any], num_speculative_tokens: int) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(to_checkpoint(head), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(head_config(head, layer_config, verifier, num_speculative_tokens), indent=2))
    return out_dir


def set_speculative_tokens(head_dir: Path, k: int) -> None:
    """Rewrite the proposal method's speculative_tokens (vLLM's default num_speculative_tokens)."""
    path = head_dir / "config.json"
    config = json.loads(path.read_text())
    config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] = k
    path.write_text(json.dumps(config, indent=2))


def read_head_config(path: Path) -> tuple[ModelArgs, HeadShape, dict]:
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise EagleFormatError(f"{path} has no config.json")
    config = json.loads(config_file.read_text())
    if config.get("speculators_model_type") != MODEL_TYPE:
        raise EagleFormatError(f"{config_file}: speculators_model_type {config.get('speculators_model_type')!r}, expected {MODEL_TYPE!r}")
    missing = [key for key in ("transformer_layer_config", "draft_vocab_size", "eagle_aux_hidden_state_layer_ids") if key not in config]
    if missing:
        raise EagleFormatError(f"{config_file}: missing {', '.join(missing)}")
    try:
        args = ModelArgs.from_hf_config(config["transformer_layer_config"])
    except (UnsupportedModelError, KeyError) as e:
        raise EagleFormatError(f"{config_file}: transformer_layer_config: {e}") from None
    if args.qkv_bias or args.o_bias or args.mlp_bias:
        raise EagleFormatError(f"{config_file}: heads with attention or MLP biases are not supported")
    shape = HeadShape(
        tuple(config["eagle_aux_hidden_state_layer_ids"]),
        config.get("target_hidden_size") or args.hidden_size,
        int(config["draft_vocab_size"]),
        bool(config.get("norm_before_residual", True)),
    )
    return args, shape, config


def from_checkpoint(tensors: dict[str, Tensor], args: ModelArgs) -> dict[str, Tensor]:
    """Speculators / vLLM names -> the runtime's state dict (q/k/v and gate/up fused)."""
    tensors = {name.replace("midlayer.", "layers.0.", 1): t for name, t in tensors.items()}  # EAGLE's original name

    def take(name: str) -> Tensor:
        try:
            return tensors[name]
        except KeyError:
            raise EagleFormatError(f"tensor {name!r} is missing from the head's checkpoint") from None

    state = {"fc.weight": take("fc.weight"), "norm.weight": take("norm.weight"), "lm_head.weight": take("lm_head.weight")}
    for i in range(args.num_layers):
        p = f"layers.{i}."
        for ours, theirs in _RUNTIME_NAMES.items():
            if ours != "hidden_norm" or i == 0:
                state[p + ours + ".weight"] = take(p + theirs + ".weight")
        state[p + "attention.wqkv.weight"] = torch.cat([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
        state[p + "feed_forward.w13.weight"] = torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])
    return state


def load_head(path: str | Path, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu") -> EagleHead:
    """An EagleHead from a speculators-format dir, in `dtype` on `device`, in eval mode."""
    path = Path(path)
    args, shape, _ = read_head_config(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise EagleFormatError(f"{path} has no *.safetensors weights")
    tensors: dict[str, Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            tensors.update({name: f.get_tensor(name) for name in f.keys()})
    head = EagleHead(args, shape)
    state = from_checkpoint(tensors, args)
    expected = {name: tuple(t.shape) for name, t in head.state_dict().items()}
    wrong = [f"{name} {tuple(state[name].shape)} != {shape_}" for name, shape_ in expected.items() if tuple(state[name].shape) != shape_]
    if wrong:
        raise EagleFormatError(f"{path}: weights do not match config.json: " + "; ".join(wrong[:4]))
    head.load_state_dict(state)
    if "d2t" in tensors:
        d2t = tensors["d2t"].long()
        if d2t.shape != (shape.draft_vocab_size,):
            raise EagleFormatError(f"{path}: d2t has shape {tuple(d2t.shape)}, expected ({shape.draft_vocab_size},)")
        head.vocab = torch.arange(shape.draft_vocab_size) + d2t
    if head.vocab.min() < 0 or head.vocab.max() >= args.vocab_size:
        raise EagleFormatError(f"{path}: d2t maps draft ids outside the target vocabulary [0, {args.vocab_size})")
    return head.to(device=device, dtype=dtype).eval()


def fit_problems(args: ModelArgs, shape: HeadShape, target_args: ModelArgs | ModelShape) -> list[str]:
    """Why a head made for another target shape cannot run on this one (vLLM refuses these too)."""
    problems = []
    if shape.target_hidden_size != target_args.hidden_size:
        problems.append(f"target_hidden_size {shape.target_hidden_size} != the target's hidden size {target_args.hidden_size}")
    if args.hidden_size != target_args.hidden_size:
        problems.append(
            f"hidden_size {args.hidden_size} != the target's {target_args.hidden_size} (the head uses the target's token embeddings)"
        )
    if args.vocab_size != target_args.vocab_size:
        problems.append(f"vocab_size {args.vocab_size} != the target's {target_args.vocab_size}")
    bad = [i for i in shape.aux_layers if not 0 <= i < target_args.num_layers]
    if bad:
        problems.append(f"aux hidden state layers {bad} are outside the target's {target_args.num_layers} layers")
    return problems


def check_fits(head: EagleHead, target_args: ModelArgs | ModelShape, where: str = "the head") -> None:
    if problems := fit_problems(head.args, head.shape, target_args):
        raise EagleFormatError(f"{where} does not fit the target: " + "; ".join(problems))
