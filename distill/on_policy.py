"""DistillSpec's on-policy data: the draft's own continuations of training prompts, which the target then
scores (distill.on_policy_fraction)."""

from __future__ import annotations

from typing import Collection

import torch


class DraftSampler:
    """DistillSpec's on-policy data: the draft's own continuations of `prompts` sampled at T = 1, each at
    most its length and ending at its first EOS, which the target then scores. Seeded, so a resumed run
    samples what an uninterrupted one did.

    They are sampled by the runtime's engine (serve/), on a GPU with CUDA graphs: transformers' `generate`
    drove every one of a step's ~256 draft forwards from Python. The engine's copy of the draft is built
    once and its weights refreshed in place before each call, so its graphs stay valid. A LoRA draft
    (peft) samples with `generate`: its weights are the base's plus the adapters'."""

    def __init__(self) -> None:
        self.runtime = None  # serve.model.Transformer: the draft's weights, fused the runtime's way
        self.engine = None

    @torch.no_grad()
    def __call__(self, model, prompts: list[list[int]], lengths: list[int], eos: Collection[int], seed: int) -> list[list[int]]:
        from peft import PeftModel

        from draftsmith.serve.model import runtime_refusal

        # the runtime samples a draft of a family it implements; transformers any other, and LoRA-wrapped ones
        runs_natively = not isinstance(model, PeftModel) and runtime_refusal(model.config.to_dict()) is None
        sample = self._engine_sample if runs_natively else self._generate
        continuations = []
        for row, length in zip(sample(model, prompts, lengths, seed), lengths):
            row = row[:length]
            ends = [i for i, token in enumerate(row) if token in eos]
            continuations.append(row[: ends[0] + 1] if ends else row)
        return continuations

    def _engine_sample(self, model, prompts: list[list[int]], lengths: list[int], seed: int) -> list[list[int]]:
        from draftsmith.serve.engine import Engine
        from draftsmith.serve.model import ModelArgs, Transformer
        from draftsmith.serve.sampling import SamplingParams
        from draftsmith.serve.weights import to_runtime_state

        device = next(model.parameters()).device
        args = ModelArgs.from_hf_config(model.config.to_dict())
        state = to_runtime_state(model.state_dict(), args)
        if args.tie_word_embeddings:
            state.pop("output.weight")
        if self.runtime is None:  # bf16 on a GPU, as mixed-precision training computes; the model's dtype on a CPU
            dtype = torch.bfloat16 if device.type == "cuda" else next(model.parameters()).dtype
            with torch.device("meta"):
                self.runtime = Transformer(args)
            missing, unexpected = self.runtime.load_state_dict(
                {k: v.to(dtype=dtype, copy=True) for k, v in state.items()}, strict=False, assign=True
            )
            if args.tie_word_embeddings:
                self.runtime.output.weight = self.runtime.tok_embeddings.weight
                missing = [m for m in missing if m != "output.weight"]
            if missing or unexpected:
                raise ValueError(f"the draft's weights do not map onto the runtime's (missing {missing[:5]}, unexpected {unexpected[:5]})")
            self.runtime.eval()
        else:
            self.runtime.load_state_dict(state, strict=False)  # copies into the same tensors
        seq_len = max(map(len, prompts)) + max(lengths) + 1
        if self.engine is None or self.engine.max_batch_size < len(prompts) or self.engine.max_seq_len < seq_len:
            self.engine = None  # the old engine's graphs and caches go before the new ones are made
            self.engine = Engine(
                self.runtime, max_batch_size=len(prompts), max_seq_len=1 << (seq_len - 1).bit_length(), compile_blocks=False
            )
        params = [SamplingParams(temperature=1.0, max_new_tokens=n, seed=seed, ignore_eos=True) for n in lengths]
        return [c.tokens for c in self.engine.generate(prompts, params).completions]

    @staticmethod
    def _generate(model, prompts: list[list[int]], lengths: list[int], seed: int) -> list[list[int]]:
        from transformers import GenerationConfig

        device = next(model.parameters()).device
        width = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, prompt in enumerate(prompts):  # left-padded, as batched generation needs
            ids[i, width - len(prompt) :] = torch.tensor(prompt)
            mask[i, width - len(prompt) :] = 1
        config = GenerationConfig(
            do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max(lengths), pad_token_id=0, eos_token_id=None
        )
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(seed)
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=config)
        return out[:, width:].tolist()
