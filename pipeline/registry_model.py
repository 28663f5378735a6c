"""A published bundle as an MLflow pyfunc: predict takes prompts and returns the target's completions,
generated speculatively with the bundle's draft and K (lossless, so the same as the target alone)."""

from __future__ import annotations

from pathlib import Path

import mlflow.pyfunc


class BundleModel(mlflow.pyfunc.PythonModel):
    def load_context(self, context) -> None:
        from transformers import AutoTokenizer

        from draftsmith.pipeline.bundle import target_dir_of, verify
        from draftsmith.serve.device import compute_dtype, pick_device
        from draftsmith.serve.engine import Engine
        from draftsmith.serve.proposers import read_vocab

        bundle = Path(context.artifacts["bundle"])
        self.k = verify(bundle, quick=True)["num_speculative_tokens"]
        device = pick_device("auto")
        dtype = str(compute_dtype("bfloat16", device)).removeprefix("torch.")
        self.engine = Engine.load(target_dir_of(bundle), bundle / "draft", dtype=dtype, device=device, draft_vocab=read_vocab(bundle))
        self.tokenizer = AutoTokenizer.from_pretrained(target_dir_of(bundle))

    def predict(self, context, model_input, params: dict | None = None) -> list[str]:
        """model_input: a list of prompts (or a DataFrame with a `prompt` column); params: max_tokens, temperature, seed."""
        from draftsmith.serve.protocol import chat_token_ids
        from draftsmith.serve.sampling import SamplingParams

        if hasattr(model_input, "columns"):  # a DataFrame: the `prompt` column, or the only one
            model_input = model_input["prompt"] if "prompt" in model_input.columns else model_input.iloc[:, 0]
        prompts = list(model_input)
        params = params or {}
        sampling = SamplingParams(
            temperature=float(params.get("temperature", 0.0)), seed=params.get("seed"), max_new_tokens=int(params.get("max_tokens", 128))
        )
        texts = []
        for prompt in prompts:
            ids = chat_token_ids(self.tokenizer, [{"role": "user", "content": prompt}])
            completion = self.engine.generate([ids], sampling, self.k).completions[0]
            texts.append(
                completion.text if completion.text is not None else self.tokenizer.decode(completion.tokens, skip_special_tokens=True)
            )
        return texts
