"""Does vLLM accept this bundle? Runs vLLM's own engine-argument and configuration code on it, on a CPU.

    VLLM_TARGET_DEVICE=cpu .venv-vllm/bin/python pipeline/vllm_check.py BUNDLE TARGET_DIR

`make vllm-check BUNDLE=...` runs it in a venv of its own (vLLM pins its own torch), after resolving the
target the bundle names. It imports vLLM only, not draftsmith: it reads speculative_config.json, builds
`vllm serve`'s EngineArgs (the target, the bundle's max_model_len, the speculative config with the draft's
path) and asks vLLM for the engine config, which loads and checks the target's and the draft's configs
(for an EAGLE-3 head: the speculators format, its verifier, its layer config), then builds the draft
with vLLM's model class and loads its weights with vLLM's loader. Exit 0 and what vLLM resolved, or
exit 1 and vLLM's own message.
"""
from __future__ import annotations

import json
import re
import sys
import tempfile
from pathlib import Path


def max_model_len(bundle: Path) -> int | None:
    """The --max-model-len that the bundle's serve.sh passes to vllm serve."""
    found = re.search(r"--max-model-len (\d+)", (bundle / "serve.sh").read_text()) if (bundle / "serve.sh").is_file() else None
    return int(found.group(1)) if found else None


def load_draft(config) -> str:
    """Build the draft with vLLM's model class and load its weights with vLLM's loader, on the CPU: where
    a head's shapes disagree with its config or the target (a wrong target_hidden_size, say), this is
    where vLLM says so. A quantized draft is not loaded: vLLM's CPU build has no kernel for its W4A16 layers."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.model_loader import get_model_loader

    draft = config.speculative_config.draft_model_config
    if getattr(draft.hf_config, "quantization_config", None):
        return "weights not loaded (a quantized draft: no W4A16 kernel in vLLM on a CPU)"
    with set_current_vllm_config(config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"file://{tempfile.mkstemp()[1]}")
        initialize_model_parallel(1, 1)
        loader = get_model_loader(config.load_config)
        with torch.device("cpu"):
            model = loader.create_model(vllm_config=config, model_config=draft)
        loader.load_weights(model, draft)
    return f"weights loaded into vLLM's {type(model).__name__}"


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    bundle, target = Path(sys.argv[1]).resolve(), sys.argv[2]
    spec = json.loads((bundle / "speculative_config.json").read_text())
    spec["model"] = str(bundle / "draft")  # the bundle's own draft, wherever the bundle is now
    try:
        from vllm.engine.arg_utils import EngineArgs
    except ImportError as e:
        print(f"vLLM does not import here ({e}): make vllm-check installs it in .venv-vllm", file=sys.stderr)
        return 2
    try:
        config = EngineArgs(model=target, max_model_len=max_model_len(bundle), speculative_config=spec).create_engine_config()
        loaded = load_draft(config)
    except Exception as e:  # noqa: BLE001 - vLLM's message is the answer
        print(f"vLLM refused the bundle {bundle}: {type(e).__name__}: {e}")
        return 1
    s = config.speculative_config
    print(f"vLLM accepts the bundle {bundle}: method {s.method}, num_speculative_tokens {s.num_speculative_tokens}, "
          f"draft {s.draft_model_config.hf_config.architectures}, target {config.model_config.hf_config.architectures}, "
          f"max_model_len {config.model_config.max_model_len}; {loaded}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
