"""A model of a family draftsmith's runtime does not implement, run by transformers behind the runtime's model
interface, so that the pipeline's evaluate stage (and its engine) can measure a draft for any causal LM that
transformers loads. Slower by design: it keeps each row's tokens by position, where the runtime's cache keeps
keys and values, and every forward runs the rows' whole sequences so far again. A step that rolls back
(rejected drafts) needs nothing special: a position sees the tokens at the positions before it, as in the
runtime's cache. No CUDA graphs, no compilation. `draftsmith serve` never loads one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from draftsmith.serve.compressed import dequantize
from draftsmith.serve.model import CachedModel, ModelShape, Transformer, runtime_refusal
from draftsmith.serve.weights import WeightsError, check_fits, load_model, read_config, read_safetensors


@dataclass
class TokenHistory:
    """What setup_cache makes: each row's tokens by position (one spare slot takes padding's writes)."""

    tokens: Tensor  # [max_batch_size, max_seq_len + 1]
    max_batch_size: int
    max_seq_len: int


class TransformersModel(CachedModel):
    graphable = False  # a forward syncs with the host (how far to run) and runs sequences of any length

    def __init__(self, hf: nn.Module, config: dict):
        super().__init__()
        self.hf = hf
        self.args = ModelShape.of(config)
        self.tok_embeddings = hf.get_input_embeddings()
        self.output = hf.get_output_embeddings()
        self.vocab: Tensor | None = None  # the token ids a draft proposes from (use_vocab)

    def setup_cache(self, max_batch_size: int, max_seq_len: int) -> TokenHistory:
        state = TokenHistory(
            torch.zeros(max_batch_size, max_seq_len + 1, dtype=torch.long, device=self.output.weight.device), max_batch_size, max_seq_len
        )
        self.use_cache(state)
        return state

    def use_cache(self, state: TokenHistory) -> None:
        self.cache_state = state

    def use_vocab(self, token_ids: Tensor) -> None:
        self.vocab = token_ids.to(self.output.weight.device)

    def forward(
        self,
        tokens: Tensor,
        positions: Tensor,
        fused: bool = False,
        logits_at: Tensor | None = None,
        cache_rows: Tensor | None = None,
        hidden_layers: tuple[int, ...] = (),
    ) -> Tensor | tuple[Tensor, Tensor]:
        """As Transformer.forward: tokens, positions [B, T] (past max_seq_len: padding), logits at every position or
        at `logits_at`, and the hidden states entering `hidden_layers`."""
        B, T = tokens.shape
        rows = torch.arange(B, device=tokens.device) if cache_rows is None else cache_rows
        slots = positions.clamp(max=self.max_seq_len)
        self.cache_state.tokens[rows.unsqueeze(1).expand(B, T), slots] = tokens
        valid = slots < self.max_seq_len
        length = int(slots[valid].max()) + 1 if bool(valid.any()) else 1
        slots = slots.clamp(max=length - 1)  # padding reads some position; its output is never used
        at = slots if logits_at is None else slots.gather(1, logits_at)  # [B, T']: where logits are wanted
        wanted = torch.unique(at)  # the positions whose logits any row needs
        out = self.hf(
            input_ids=self.cache_state.tokens[rows, :length],
            logits_to_keep=wanted,
            output_hidden_states=bool(hidden_layers),
            use_cache=False,
        )
        index = torch.searchsorted(wanted, at).unsqueeze(-1)  # into the kept positions
        logits = out.logits.gather(1, index.expand(-1, -1, out.logits.shape[-1]))
        if self.vocab is not None:
            logits = logits[..., self.vocab]
        if not hidden_layers:
            return logits
        every = slots.unsqueeze(-1).expand(-1, -1, self.args.hidden_size)  # hidden states at all T positions
        return logits, torch.cat([out.hidden_states[i].gather(1, every) for i in hidden_layers], dim=-1)


def load_transformers_model(path: Path, dtype: torch.dtype, device: str | torch.device) -> TransformersModel:
    """An HF dir's model in transformers (safetensors only; a compressed-tensors W4A16 / W8A16 draft
    dequantized at load as the runtime does), in eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = read_config(path)
    if "quantization_config" not in config:
        check_fits(path, dtype, device)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, use_safetensors=True)
    else:
        plain = AutoConfig.from_pretrained(path)
        del plain.quantization_config
        hf = AutoModelForCausalLM.from_config(plain, dtype=dtype)  # a draft: small, made in memory then overwritten
        state = dequantize(read_safetensors(path), config["quantization_config"], dtype)
        missing, unexpected = hf.load_state_dict(state, strict=False)
        if config.get("tie_word_embeddings"):
            hf.tie_weights()
            missing = [m for m in missing if m != "lm_head.weight"]
        if missing or unexpected:
            raise WeightsError(f"{path}: weights do not match config.json (missing {missing[:5]}, unexpected {unexpected[:5]})")
    return TransformersModel(hf.to(device=device, dtype=dtype).eval(), config)


def load_any(path: Path, dtype: torch.dtype, device: str | torch.device) -> Transformer | TransformersModel:
    """The runtime's model of an HF dir, or where the runtime does not implement its family, the model in
    transformers behind the same interface (the pipeline's stages; `draftsmith serve` loads runtime models only)."""
    if runtime_refusal(read_config(path)) is not None:
        return load_transformers_model(path, dtype, device)
    return load_model(path, dtype, device)
