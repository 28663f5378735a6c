"""The `draftsmith` command line."""
from __future__ import annotations

import sys
from pathlib import Path

import typer

app = typer.Typer(help="draftsmith: distil, quantize, evaluate and serve speculative-decoding drafts.",
                  no_args_is_help=True, pretty_exceptions_enable=False)


@app.callback()
def cli() -> None:
    """draftsmith: distil, quantize, evaluate and serve speculative-decoding drafts."""


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def run(ctx: typer.Context) -> None:
    """Run the pipeline as a Hydra app, with key=value overrides; -m runs a multirun sweep

    Usage: draftsmith run [-m] [key=value ...]. Examples: `draftsmith run preset=gpu`, `draftsmith run -m distill.loss=tvd,jsd`.
    Hydra's own options (--cfg job, --info, -m) pass through.
    """
    from draftsmith.pipeline import app as hydra_app
    from draftsmith.pipeline.tracking import close_parent_if_open

    sys.argv = ["draftsmith-run", *ctx.args]
    status = "FAILED"
    try:
        hydra_app.main()
        status = "FINISHED"
    except SystemExit as e:
        status = "FINISHED" if not e.code else "FAILED"
        raise
    finally:
        close_parent_if_open(status)


def main() -> None:
    app()


bench = typer.Typer(help="Speed benchmarks that print ratios side by side.", no_args_is_help=True)
app.add_typer(bench, name="bench")


@bench.command("decode")
def bench_decode(
    target: str = typer.Option("demo", help="target: 'demo', an HF model dir or a .gguf file"),
    draft: Path = typer.Option(None, help="draft HF dir; default: the target's embeddings, head and --draft-layers of its layers"),
    draft_layers: int = typer.Option(4, help="layers of the default from-target draft"),
    new_tokens: int = typer.Option(256, help="tokens generated per run (EOS ignored)"),
    k: list[int] = typer.Option([2, 4, 6], "--k", help="num_speculative_tokens to measure (repeatable)"),
    device: str = typer.Option("auto", help="auto, cpu or cuda"),
    dtype: str = typer.Option("bfloat16", help="bfloat16, float16 or float32"),
    repeats: int = typer.Option(3, help="timed runs per row after a warm-up; the fastest counts"),
    transformers_baseline: bool = typer.Option(True, help="include transformers generate"),
    assisted: bool = typer.Option(False, help="include transformers assisted generation with the same draft"),
    out: Path = typer.Option(None, help="write the rows as JSON here"),
    cache_dir: str = typer.Option("~/.cache/draftsmith", help="where converted targets are kept"),
) -> None:
    """Decode speed at batch 1, greedy: transformers generate, plain decode eager and with CUDA graphs, speculative."""
    import tempfile

    import torch
    from rich.console import Console
    from rich.table import Table

    from draftsmith.distill.draft import build_from_target, every_nth_layer
    from draftsmith.evaluate.bench_decode import run_bench, write_results
    from draftsmith.pipeline.config import TargetConfig
    from draftsmith.pipeline.target import resolve_target_dir
    from draftsmith.serve.weights import read_config

    device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    target_dir = resolve_target_dir(TargetConfig(name_or_path=target, cache_dir=cache_dir, gguf_file=None))
    with tempfile.TemporaryDirectory() as tmp:
        if draft is None:
            layers = every_nth_layer(read_config(target_dir)["num_hidden_layers"], draft_layers)
            draft = build_from_target(target_dir, Path(tmp) / "draft", layers)
        rows = run_bench(target_dir, draft, new_tokens=new_tokens, ks=tuple(k), device=device, dtype=dtype,
                         repeats=repeats, with_transformers=transformers_baseline, with_assisted=assisted)
    hf = next((r for r in rows if r.method == "transformers generate"), None)
    plain = [r for r in rows if r.method.startswith("plain")][-1]  # with CUDA graphs where there are any
    table = Table(title=f"bench decode: {target} on {device}, batch 1, {new_tokens} new tokens, greedy")
    for column in ("method", "tok/s", "ms/step", "tau", "alpha", "x HF", "x plain", "=plain"):
        table.add_column(column, justify="right" if column != "method" else "left")
    for r in rows:
        table.add_row(r.method, f"{r.tokens_per_s:.1f}", f"{r.ms_per_target_step:.3f}",
                      f"{r.tau:.2f}" if r.tau else "", f"{r.acceptance_rate:.2f}" if r.acceptance_rate is not None else "",
                      f"{r.tokens_per_s / hf.tokens_per_s:.1f}x" if hf else "", f"{r.tokens_per_s / plain.tokens_per_s:.2f}x",
                      {True: "yes", False: "no", None: ""}[r.matches_plain])
    Console().print(table)
    if out:
        write_results(rows, out, " ".join(sys.argv), device, {"target": target, "draft": str(draft)})


@app.command()
def serve(
    source: str = typer.Argument(..., help="a bundle dir, or models:/<name>@champion from the MLflow registry"),
    host: str = typer.Option("127.0.0.1"), port: int = typer.Option(8000),
    device: str = typer.Option("auto", help="auto, cpu or cuda"),
    dtype: str = typer.Option("bfloat16", help="bfloat16 or float16 on a GPU (float32 on CPU)"),
    max_model_len: int = typer.Option(2048, help="prompt plus new tokens, at most"),
    api_key: str = typer.Option(None, help="require 'Authorization: Bearer <key>' on /v1/*"),
    tracking_uri: str = typer.Option(None, help="MLflow URI for models:/ sources; default: $MLFLOW_TRACKING_URI or runs/demo"),
) -> None:
    """Serve a bundle over an OpenAI-compatible HTTP API, speculative with the bundle's K (verified first)."""
    import os

    import uvicorn

    from draftsmith.pipeline.bundle import BundleError
    from draftsmith.serve.server import BundleSourceError, create_app, load_server, resolve_bundle

    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path('runs/demo/mlflow.db').resolve()}"
    try:
        server = load_server(resolve_bundle(source, uri), device, dtype, max_model_len)
    except (BundleError, BundleSourceError) as e:
        typer.echo(str(e), err=True)
        raise typer.Exit(1) from None
    uvicorn.run(create_app(server, api_key), host=host, port=port)


bundle_app = typer.Typer(help="Published bundles.", no_args_is_help=True)
app.add_typer(bundle_app, name="bundle")


@bundle_app.command("verify")
def bundle_verify(path: Path = typer.Argument(..., help="the bundle dir")) -> None:
    """Check the manifest, tokenizer identity, vocab sizes and speculative_config against vLLM's constraints."""
    from draftsmith.pipeline.bundle import BundleError, verify

    try:
        spec = verify(path)
    except BundleError as e:
        typer.echo(str(e), err=True)
        raise typer.Exit(1) from None
    typer.echo(f"{path}: ok (num_speculative_tokens={spec['num_speculative_tokens']})")


registry_app = typer.Typer(help="Registered bundles in the MLflow model registry.", no_args_is_help=True)
app.add_typer(registry_app, name="registry")
URI_HELP = "MLflow tracking/registry URI; default: the embedded sqlite store of --root"


def _registry_uri(uri: str | None, root: str) -> str:
    from draftsmith.pipeline.tracking import tracking_uri

    return tracking_uri(uri, root)


@registry_app.command("list")
def registry_list(name: str = typer.Option("draftsmith-draft", help="registered model name"),
                  uri: str = typer.Option(None, help=URI_HELP), root: str = typer.Option("runs/demo", help="run root")) -> None:
    """Every version with its tau, alpha, K, quantization and why it was (not) promoted."""
    from rich.console import Console
    from rich.table import Table

    from draftsmith.pipeline.registry import list_versions

    rows = list_versions(_registry_uri(uri, root), name)
    table = Table(title=f"registry: {name}")
    for column in ("version", "champion", "tau", "alpha", "k", "quantization", "gates_passed", "reason"):
        table.add_column(column)
    for row in rows:
        table.add_row(*(row[c] for c in ("version", "champion", "tau", "alpha", "k", "quantization", "gates_passed", "reason")))
    Console().print(table)


@registry_app.command("promote")
def registry_promote(version: str = typer.Argument(..., help="version to make champion"),
                     name: str = typer.Option("draftsmith-draft", help="registered model name"),
                     uri: str = typer.Option(None, help=URI_HELP), root: str = typer.Option("runs/demo", help="run root")) -> None:
    """Make VERSION the champion by hand (the one it replaces is remembered for rollback)."""
    from draftsmith.pipeline.registry import RegistryError, promote

    try:
        promote(_registry_uri(uri, root), name, version)
    except RegistryError as e:
        typer.echo(str(e), err=True)
        raise typer.Exit(1) from None
    typer.echo(f"{name}@champion -> version {version}")


@registry_app.command("rollback")
def registry_rollback(name: str = typer.Option("draftsmith-draft", help="registered model name"),
                      uri: str = typer.Option(None, help=URI_HELP), root: str = typer.Option("runs/demo", help="run root")) -> None:
    """Point champion back at the version the current champion replaced."""
    from draftsmith.pipeline.registry import RegistryError, rollback

    try:
        version = rollback(_registry_uri(uri, root), name)
    except RegistryError as e:
        typer.echo(str(e), err=True)
        raise typer.Exit(1) from None
    typer.echo(f"{name}@champion -> version {version}")


if __name__ == "__main__":
    main()
