"""What `draftsmith serve` serves: a bundle dir or a registered model, verified, loaded into the runtime's
server. (The runtime, serve/, reads no bundle: this is where a bundle becomes an engine.)"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from draftsmith.pipeline.bundle import SPECULATIVE_CONFIG, TARGET_JSON, target_dir_of, verify

if TYPE_CHECKING:
    from draftsmith.serve.scheduler import Scheduler
    from draftsmith.serve.server import Server


class BundleSourceError(ValueError):
    """`draftsmith serve` was given something that is neither a bundle dir nor a models:/ URI, or a bundle whose
    target's family its runtime does not implement."""


def resolve_bundle(source: str, tracking_uri: str | None = None) -> Path:
    """A bundle dir, or the bundle inside a registered model (`models:/<name>@<alias>` or `/<version>`)."""
    if source.startswith("models:/"):
        import mlflow
        from mlflow.exceptions import MlflowException

        if tracking_uri and tracking_uri.startswith("sqlite:///") and not Path(tracking_uri.removeprefix("sqlite:///")).is_file():
            raise BundleSourceError(
                f"{source}: there is no MLflow store at {tracking_uri} (--tracking-uri names the registry; "
                "the pipeline's is sqlite:///<run root>/mlflow.db)"
            )
        if tracking_uri:
            mlflow.set_tracking_uri(tracking_uri)
            mlflow.set_registry_uri(tracking_uri)
        try:
            local = Path(mlflow.artifacts.download_artifacts(artifact_uri=source))
        except (MlflowException, OSError) as e:
            first = (getattr(e, "message", None) or str(e)).strip().splitlines()[0]
            raise BundleSourceError(
                f"{source} could not be read from the registry at {tracking_uri or 'the default URI'}: "
                f"{first} (--tracking-uri names the registry)"
            ) from None
        found = [p.parent for p in local.rglob("manifest.json") if p.parent.name == "bundle"]
        if not found:
            raise BundleSourceError(f"{source} holds no draftsmith bundle")
        return found[0]
    path = Path(source)
    if not path.is_dir():
        raise BundleSourceError(f"{source}: no such bundle dir (or give models:/<name>@champion)")
    return path


def load_server(
    bundle: Path,
    device: str,
    dtype: str,
    max_model_len: int,
    max_batch_size: int = 16,
    target: str | None = None,
    engine_process: bool = True,
    adaptive_k: bool = True,
    lookup_first: int = 0,
    **options,
) -> "Server":
    """Verify the bundle (the same checks as `draftsmith bundle verify`, with `target` instead of the
    recorded one if given), then load target and draft: in a process of their own (engine_process), else in
    this one; `options` are the Server's (smooth_stream, the stop-string limits)."""
    from transformers import AutoTokenizer

    from draftsmith.serve.engine_process import EngineProcess
    from draftsmith.serve.model import runtime_refusal
    from draftsmith.serve.server import Server
    from draftsmith.serve.weights import read_config

    spec = verify(bundle, target)
    target_dir = target_dir_of(bundle, target)
    if (refusal := runtime_refusal(read_config(target_dir))) is not None:  # made with target.fallback=transformers
        raise BundleSourceError(
            f"{refusal}: draftsmith serve runs targets in its own model code only; serve this bundle with vLLM (serve.sh)"
        )
    k = spec["num_speculative_tokens"]
    load = partial(load_scheduler, bundle, device, dtype, max_model_len, max_batch_size, target, adaptive_k, lookup_first)
    engine = EngineProcess(load) if engine_process else load()
    reference = bundle / TARGET_JSON
    name = json.loads(reference.read_text())["name_or_path"] if reference.is_file() else target_dir.name
    return Server(engine, AutoTokenizer.from_pretrained(target_dir), str(name), k, max_model_len, adaptive_k=adaptive_k, **options)


def load_scheduler(
    bundle: Path,
    device: str,
    dtype: str,
    max_model_len: int,
    max_batch_size: int,
    target: str | None,
    adaptive_k: bool,
    lookup_first: int = 0,
) -> "Scheduler":
    """The bundle's target and draft in an engine, under a scheduler with the bundle's K (the bundle verified
    already); lookup_first > 0: prompt lookup drafts for rows whose last lookup_first tokens occurred earlier."""
    from draftsmith.serve.device import pick_device
    from draftsmith.serve.engine import Engine
    from draftsmith.serve.proposers import LookupFirst, read_vocab
    from draftsmith.serve.scheduler import Scheduler

    spec = json.loads((bundle / SPECULATIVE_CONFIG).read_text())
    device = pick_device(device)
    engine = Engine.load(
        target_dir_of(bundle, target),
        bundle / spec["model"],
        dtype=dtype if device != "cpu" else "float32",
        device=device,
        max_batch_size=max_batch_size,
        draft_vocab=read_vocab(bundle),
        max_seq_len=max_model_len + spec["num_speculative_tokens"] + 1,
    )
    proposer = LookupFirst(engine.draft_proposer, engine.target.args.vocab_size, lookup_first) if lookup_first else None
    return Scheduler(engine, spec["num_speculative_tokens"], adaptive=adaptive_k, proposer=proposer)
