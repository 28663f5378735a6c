"""The `draftsmith` command line."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

app = typer.Typer(
    help="draftsmith: distil, quantize, evaluate and serve speculative-decoding drafts.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)


@app.callback()
def cli() -> None:
    """draftsmith: distil, quantize, evaluate and serve speculative-decoding drafts."""


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True}, options_metavar="[-m] [KEY=VALUE ...]")
def run(ctx: typer.Context) -> None:
    """Run the pipeline as a Hydra app, with key=value overrides; -m runs a multirun sweep.

    Examples: `draftsmith run preset=gpu`, `draftsmith run -m distill.loss=tvd,jsd`. Hydra's own options
    pass through: --cfg job, --info, -sc install=bash (tab completion of config keys for `draftsmith run`).
    """
    quiet_libraries()  # before the libraries are imported: some read their switches at import time
    from draftsmith.pipeline import app as hydra_app
    from draftsmith.pipeline.sweep import print_summary
    from draftsmith.pipeline.tracking import close_parent_if_open

    sys.argv = ["draftsmith", *ctx.args]  # Hydra's completion script registers the program of argv[0]
    status = "FAILED"
    try:
        hydra_app.main()
        status = "FINISHED"
    except SystemExit as e:
        status = "FINISHED" if not e.code else "FAILED"
        raise
    finally:
        close_parent_if_open(status)
        print_summary(hydra_app.console)


def print_table(table) -> None:
    """A rich table on stdout; a log or a pipe gets whole cells (rich cuts them at 80 columns without a terminal)."""
    from rich.console import Console

    Console(width=None if sys.stdout.isatty() else 200).print(table)


def quiet_libraries() -> None:
    """Our own progress bars and log lines only: the libraries' bars (transformers' weight loading, datasets'
    saving, llm-compressor's AWQ grid search: hundreds of lines in a log) and llm-compressor's log lines, which
    say nothing our user can act on ("No accelerator available!" on a CPU, GPTQ's per-layer errors), are off;
    the stages report what those steps did. tqdm and llm-compressor read these switches when imported."""
    import os

    for name, value in (
        ("TQDM_DISABLE", "1"),
        ("HF_DATASETS_DISABLE_PROGRESS_BARS", "1"),
        ("LLM_COMPRESSOR_LOG_LEVEL", "ERROR"),
        ("TRANSFORMERS_VERBOSITY", "error"),
    ):
        os.environ.setdefault(name, value)


def main() -> None:
    if len(sys.argv) >= 3 and sys.argv[1] in ("-sc", "--shell-completion") and sys.argv[2].startswith("query="):
        complete(sys.argv[2])  # what the script of `draftsmith run -sc install=bash` asks on <TAB>
        return
    app()


def complete(query: str) -> None:
    """Shell completion: the commands, and after `run` Hydra's completion of config groups and keys (the
    completion line without `run`, as Hydra would see it for an app of its own)."""
    import os

    line = os.environ.get("COMP_LINE", "")
    words = line.split()
    if len(words) >= 2 and words[1] == "run" and (len(words) > 2 or line.endswith(" ")):
        from draftsmith.pipeline import app as hydra_app

        os.environ["COMP_LINE"] = line.replace(" run", "", 1)
        sys.argv = ["draftsmith", "-sc", query]
        hydra_app.main()
    else:
        print("run serve bundle registry bench")


bench = typer.Typer(help="Speed benchmarks that print ratios side by side.", no_args_is_help=True)
app.add_typer(bench, name="bench")


def plainly(command):
    """A bench command whose bad input (a file that is not there, a target or draft this runtime cannot load, a
    server that does not answer) ends it with one line on stderr and exit status 1, not a traceback."""
    import functools

    @functools.wraps(command)
    def run(*args, **kwargs):
        import httpx

        from draftsmith.distill.data import DataError
        from draftsmith.pipeline.target import TargetError
        from draftsmith.serve.compressed import CompressedFormatError
        from draftsmith.serve.device import DeviceError
        from draftsmith.serve.eagle import EagleFormatError
        from draftsmith.serve.model import UnsupportedModelError
        from draftsmith.serve.weights import WeightsError

        said = (DataError, TargetError, CompressedFormatError, DeviceError, EagleFormatError, UnsupportedModelError, WeightsError)
        try:
            return command(*args, **kwargs)
        except said as e:
            typer.echo(f"error: {e}", err=True)
        except httpx.TransportError as e:
            typer.echo(f"error: the server did not answer ({type(e).__name__}: {e})", err=True)
        raise typer.Exit(1)

    return run


@bench.command("decode")
@plainly
def bench_decode(
    target: str = typer.Option("demo", help="target: 'demo', an HF model dir or a .gguf file"),
    draft: list[Path] = typer.Option(
        [],
        "--draft",
        help="a draft model dir or an EAGLE-3 head dir (repeatable: side by side); "
        "default: the target's embeddings, head and --draft-layers of its layers",
    ),
    draft_layers: int = typer.Option(4, help="layers of the default from-target draft"),
    new_tokens: int = typer.Option(256, help="tokens generated per prompt (EOS ignored unless --stop-at-eos)"),
    stop_at_eos: bool = typer.Option(
        False,
        "--stop-at-eos",
        help="end each answer at EOS, as served (else exactly --new-tokens: text past an answer's end is easier to draft)",
    ),
    prompts: int = typer.Option(8, help="the first N held-out prompts, run one after another at batch 1 (the split's size: all)"),
    data: str = typer.Option(
        "demo", help="a .jsonl of prompts whose held-out split to take, as the data stage splits it; 'demo': the demo's"
    ),
    eval_fraction: float = typer.Option(0.1, help="the held-out fraction of --data (data.eval_fraction; preset=qwen_coder's: 0.2)"),
    batch: int = typer.Option(16, help="also measure continuous batching with this many requests at once (0: skip)"),
    k: list[int] = typer.Option([2, 4, 6], "--k", help="num_speculative_tokens to measure (repeatable)"),
    device: str = typer.Option("auto", help="auto, cpu or cuda"),
    dtype: str = typer.Option("bfloat16", help="bfloat16, float16 or float32"),
    repeats: int = typer.Option(3, help="timed runs per row after a warm-up run; the median counts, the spread is shown"),
    transformers_baseline: bool = typer.Option(False, help="include transformers generate"),
    assisted: bool = typer.Option(False, help="include transformers assisted generation with the (first) draft model"),
    eager: bool = typer.Option(False, help="include plain decoding eager and with CUDA graphs but no compiled blocks"),
    lookup: bool = typer.Option(False, "--lookup", help="each draft with prompt lookup first, and prompt lookup alone, at each K"),
    device_lookup: bool = typer.Option(False, "--device-lookup", help="each draft with lookup first searched on the device, at each K"),
    out: Path = typer.Option(None, help="write the rows as JSON here, again after each row (a run cut short keeps what it measured)"),
    cache_dir: str = typer.Option("~/.cache/draftsmith", help="where converted targets are kept"),
) -> None:
    """Decode speed, greedy, each row the median of --repeats runs: at batch 1 plain decoding and each draft at
    each K; then plain and adaptive-K speculative with each draft at --batch requests at once."""
    import tempfile

    import torch

    from draftsmith.distill.data import heldout_messages
    from draftsmith.distill.draft import build_from_target, every_nth_layer
    from draftsmith.evaluate.bench_decode import chat_prompts, results_table, run_bench, write_results
    from draftsmith.pipeline.config import TargetConfig
    from draftsmith.pipeline.target import resolve_target_dir
    from draftsmith.serve.weights import read_config

    device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    target_dir = resolve_target_dir(TargetConfig(name_or_path=target, cache_dir=cache_dir, gguf_file=None))
    with tempfile.TemporaryDirectory() as tmp:
        if not draft:
            layers = every_nth_layer(read_config(target_dir)["num_hidden_layers"], draft_layers)
            draft = [build_from_target(target_dir, Path(tmp) / "draft", layers)]
        heldout = heldout_messages(data, fraction=eval_fraction)
        ids = chat_prompts(target_dir, heldout[:prompts])
        if not ids:
            raise typer.BadParameter(f"{data} has no prompts in its held-out split at --eval-fraction {eval_fraction}")
        command, about = " ".join(sys.argv), {"target": target, "drafts": [str(d) for d in draft]}
        rows = run_bench(
            target_dir,
            draft,
            ids,
            new_tokens=new_tokens,
            ks=tuple(k),
            device=device,
            dtype=dtype,
            repeats=repeats,
            with_transformers=transformers_baseline,
            with_assisted=assisted,
            with_eager=eager,
            batch=batch,
            stop_at_eos=stop_at_eos,
            lookup=lookup,
            device_lookup=device_lookup,
            on_row=lambda rows: write_results(rows, out, command, device, about) if out else None,
        )
    length = f"up to {new_tokens} new tokens (to EOS)" if stop_at_eos else f"{new_tokens} new tokens"
    title = (
        f"bench decode: {target} on {device}, {len(ids)} of {len(heldout)} held-out prompts x {length}, greedy, median of {repeats} runs"
    )
    print_table(results_table(rows, title, dtype))


@bench.command("serve")
@plainly
def bench_serve_command(
    url: str = typer.Option("http://127.0.0.1:8000", help="a running draftsmith serve or vllm serve"),
    concurrency: list[int] = typer.Option([1, 4, 16, 64], "--concurrency", help="client counts to measure (repeatable)"),
    max_tokens: int = typer.Option(256, help="max_tokens per request (greedy)"),
    duration: float = typer.Option(30.0, help="seconds of load per concurrency level"),
    prompts: str = typer.Option("demo", help="a .jsonl of prompts (field 'prompt' or 'messages'); 'demo': the held-out demo prompts"),
    api_key: str = typer.Option(None, help="sent as 'Authorization: Bearer <key>'"),
    out: Path = typer.Option(None, help="write the rows as JSON here"),
    compare_engine: Path = typer.Option(
        None,
        "--compare-engine",
        help="a bundle: serve it from this process instead of loading --url, then run its engine alone on the same prompts and settings",
    ),
    device: str = typer.Option("auto", help="with --compare-engine: auto, cpu or cuda"),
    repeats: int = typer.Option(
        1, min=1, help="with --compare-engine: rounds over the levels after one warm-up; a summary gives the medians and the ratio's spread"
    ),
) -> None:
    """Load a server with streaming chat clients: throughput and TTFT / TPOT p50 and p99 per concurrency."""
    import json

    from rich.table import Table

    from draftsmith.distill.data import heldout_messages, read_records, to_messages
    from draftsmith.evaluate import bench_serve as bench

    chats = heldout_messages() if prompts == "demo" else [m for m in (to_messages(r, "prompt") for r in read_records(prompts)) if m]
    columns = ("concurrency", "requests", "errors", "tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms")
    if compare_engine:
        from draftsmith.serve.server import console_log

        console_log()
        rows = bench.compare_engine(compare_engine, chats, concurrency, max_tokens, duration, device, repeats=repeats)
        url, columns = (
            f"draftsmith serve {compare_engine} (in process)",
            ("repeat",) + columns + ("engine_tokens_per_s", "server_over_engine", "engine_busy", "http_busy", "engine_busy_alone"),
        )
    else:
        rows = bench.bench_serve(url, chats, concurrency, max_tokens, duration, api_key)

    def print_rows(title: str, rows: list[dict], columns: tuple[str, ...]) -> None:
        table = Table(title=title)
        for column in columns:
            table.add_column(column, justify="right")
        for row in rows:
            table.add_row(*(str(row[c]) for c in columns))
        print_table(table)

    print_rows(f"bench serve: {url}, {max_tokens} max tokens, greedy, {duration:g} s per level", rows, columns)
    summary = bench.median_rows(rows) if compare_engine else None
    if summary:
        print_rows(f"medians over {repeats} run(s) per level (ratio_low / ratio_high: its spread)", summary, tuple(summary[0]))
    if out:
        out.write_text(
            json.dumps({"command": " ".join(sys.argv), "url": url, "rows": rows} | ({"medians": summary} if summary else {}), indent=2)
        )
    if any(row["errors"] for row in rows):
        typer.echo(f"errors: {next(row['first_error'] for row in rows if row['errors'])}", err=True)
        raise typer.Exit(1)


@bench.command("shapes")
@plainly
def bench_shapes(
    shape: list[str] = typer.Option(
        ["llama-3.1-8b"],
        "--shape",
        help="a named target shape (repeatable): llama-3.1-8b, qwen2.5-7b, qwen3-8b, qwen2.5-1.5b, smollm2-135m, tiny",
    ),
    batch: list[int] = typer.Option([1, 16], "--batch", help="batch sizes (repeatable)"),
    k: list[int] = typer.Option([2, 4], "--k", help="num_speculative_tokens (repeatable)"),
    draft_layers: int = typer.Option(2, help="layers of the draft model, of the target's width"),
    draft_vocab: int = typer.Option(32768, help="the EAGLE-3 head's draft vocabulary"),
    eval_json: str = typer.Option(None, "--acceptance", help="an eval.json whose shipped draft's tau by K projects the speedup"),
    alpha: float = typer.Option(None, help="or project from this per-token acceptance (Leviathan's expected length)"),
    new_tokens: int = typer.Option(128, help="tokens decoded per row"),
    prompt_tokens: int = typer.Option(128, help="prompt length (random tokens)"),
    repeats: int = typer.Option(3, help="timed runs per row after a warm-up run; the median counts"),
    bandwidth: float = typer.Option(
        None, help="the device's memory bandwidth in GB/s, for the plain step's floor (default: its datasheet's, H200/H100/A100)"
    ),
    device: str = typer.Option("auto", help="auto, cpu or cuda"),
    dtype: str = typer.Option("bfloat16", help="bfloat16, float16 or float32"),
    out: Path = typer.Option(None, help="write the rows as JSON here"),
) -> None:
    """Decoding cost at a target's shape without its weights (random weights on the device): plain steps, the
    verify forward over 1..K+1 tokens, a draft model's and an EAGLE-3 head's whole steps, and the projected
    speedup of an acceptance curve."""
    import json

    import torch

    from draftsmith.evaluate.bench_shapes import (
        SHAPES,
        acceptance_curve,
        as_dicts,
        bandwidth_floor_ms,
        build,
        datasheet_bandwidth,
        results_table,
        run_shape,
    )
    from draftsmith.serve.device import DTYPES

    unknown = [name for name in shape if name not in SHAPES]
    if unknown:
        typer.echo(f"unknown shape {unknown[0]!r}: one of {', '.join(SHAPES)}", err=True)
        raise typer.Exit(2)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    tau = acceptance_curve(eval_json, alpha, k)
    gpu = torch.cuda.get_device_name() if device.startswith("cuda") else None
    bandwidth = bandwidth or (datasheet_bandwidth(gpu) if gpu else None)
    if bandwidth is None:
        typer.echo("no memory bandwidth known for this device (--bandwidth GB/s): the table leaves out the floor", err=True)
    rows, floors = [], {}
    for name in shape:
        floors[name] = bandwidth_floor_ms(build(SHAPES[name], DTYPES[dtype], "meta"), bandwidth) if bandwidth else None
        rows += run_shape(name, batch, k, draft_layers, draft_vocab, tau, device, DTYPES[dtype], new_tokens, prompt_tokens, repeats)
    title = (
        f"bench shapes on {device}, {dtype}, random weights, {prompt_tokens}-token prompts, {new_tokens} new tokens, median of {repeats}"
    )
    table = results_table(rows, floors, title)
    print_table(table)
    if out:
        out.write_text(
            json.dumps(
                {
                    "rows": as_dicts(rows),
                    "bandwidth_floor_ms": floors,
                    "bandwidth_gb_s": bandwidth,
                    "tau": tau,
                    "device": device,
                    "gpu": gpu,
                },
                indent=2,
            )
        )


@app.command()
def serve(
    source: str = typer.Argument(..., help="a bundle dir, or models:/<name>@champion from the MLflow registry"),
    host: str = typer.Option("127.0.0.1"),
    port: int = typer.Option(8000),
    device: str = typer.Option("auto", help="auto, cpu or cuda"),
    dtype: str = typer.Option("bfloat16", help="bfloat16 or float16 on a GPU (float32 on CPU)"),
    max_model_len: int = typer.Option(2048, help="prompt plus new tokens, at most"),
    max_batch_size: int = typer.Option(16, help="requests in the running batch at once; more wait for a free row"),
    adaptive_k: bool = typer.Option(
        True,
        help="choose K per step from each request's acceptance and the measured "
        "step costs (0 where speculation would slow the batch); off: the bundle's K",
    ),
    smooth_stream: int = typer.Option(0, help="stream accepted tokens in groups of this many, evenly paced (0: as they come)"),
    lookup_first: int = typer.Option(
        0,
        min=0,
        max=3,
        help="a row whose last N tokens occurred earlier in its text takes prompt lookup's drafts instead of the draft's "
        "(code that repeats its prompt); where every row does, the draft does not run. Pays most with an EAGLE-3 head "
        "(3 on code); with a draft model at large batches it can cost more than it saves. 0: off",
    ),
    api_key: str = typer.Option(None, help="require 'Authorization: Bearer <key>' on /v1/*"),
    max_body_bytes: int = typer.Option(4 << 20, help="larger request bodies get 413"),
    max_stop_strings: int = typer.Option(None, help="stop strings a request may send; more get 400 (default 64)"),
    max_stop_string_chars: int = typer.Option(None, help="characters a stop string may have; longer get 400 (default 4096)"),
    tracking_uri: str = typer.Option(None, help="MLflow URI for models:/ sources; default: $MLFLOW_TRACKING_URI or runs/demo"),
    target: str = typer.Option(
        None,
        help="the target (an HF dir or a hub id) when it is not where target.json says; checked against the sha256 recorded at publish",
    ),
) -> None:
    """Serve a bundle over an OpenAI-compatible HTTP API, speculative with the bundle's K (verified first)."""
    import os

    import uvicorn

    from draftsmith.pipeline.bundle import BundleError
    from draftsmith.pipeline.serving import BundleSourceError, load_server, resolve_bundle
    from draftsmith.serve.engine_process import EngineProcessError
    from draftsmith.serve.server import console_log, create_app

    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path('runs/demo/mlflow.db').resolve()}"
    try:
        limits = {
            key: value
            for key, value in (("max_stop_strings", max_stop_strings), ("max_stop_chars", max_stop_string_chars))
            if value is not None
        }
        server = load_server(
            resolve_bundle(source, uri),
            device,
            dtype,
            max_model_len,
            max_batch_size,
            target,
            adaptive_k=adaptive_k,
            lookup_first=lookup_first,
            smooth_stream=smooth_stream,
            **limits,
        )
    except (BundleError, BundleSourceError, EngineProcessError) as e:
        typer.echo(str(e), err=True)
        raise typer.Exit(1) from None
    console_log()
    http = uvicorn.Server(uvicorn.Config(create_app(server, api_key, max_body_bytes), host=host, port=port))
    server.on_failure = lambda: setattr(http, "should_exit", True)
    http.run()
    if server.failed is not None:
        typer.echo(server.failure, err=True)
        raise typer.Exit(1)


bundle_app = typer.Typer(help="Published bundles.", no_args_is_help=True)
app.add_typer(bundle_app, name="bundle")


@bundle_app.command("verify")
def bundle_verify(
    path: Path = typer.Argument(..., help="the bundle dir"),
    target: str = typer.Option(None, help="another copy of the target (an HF dir or a hub id) to check"),
    quick: bool = typer.Option(False, help="do not hash the target's weight files"),
) -> None:
    """Check the manifest, the weights against their configs, the target against target.json, tokenizer
    identity, vocab sizes and speculative_config against vLLM's constraints; list every problem."""
    from draftsmith.pipeline.bundle import BundleError, verify

    try:
        spec = verify(path, target, quick)
    except BundleError as e:
        typer.echo(str(e), err=True)
        raise typer.Exit(1) from None
    typer.echo(f"{path}: ok (num_speculative_tokens={spec['num_speculative_tokens']})")


registry_app = typer.Typer(help="Registered bundles in the MLflow model registry.", no_args_is_help=True)
app.add_typer(registry_app, name="registry")
URI_HELP = "MLflow tracking/registry URI; default: the config's (tracking.uri, else the sqlite store under paths.root)"
NAME_HELP = "registered model name; default: the config's tracking.registry_name"
OVERRIDES = {"context_settings": {"allow_extra_args": True, "ignore_unknown_options": True}, "options_metavar": "[OPTIONS] [KEY=VALUE ...]"}


def _registry(ctx: typer.Context, uri: str | None, name: str | None) -> tuple[str, str]:
    """(URI, model name) found the way `draftsmith run` finds them: --uri, else the config (with the KEY=VALUE
    overrides given, as for run) names tracking.uri or the sqlite store under paths.root. A store that does not
    exist is an error that says where it looked: nothing is created."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from draftsmith.pipeline.config import ConfigError, composed
    from draftsmith.pipeline.tracking import run_root

    try:
        cfg = composed(*ctx.args)
    except (ConfigError, HydraException, OmegaConfBaseException) as e:
        typer.echo(f"configuration error: {e}", err=True)
        raise typer.Exit(2) from None
    name = name or cfg.tracking.registry_name
    if uri or cfg.tracking.uri:
        return uri or cfg.tracking.uri, name
    store = run_root(cfg.paths.root) / "mlflow.db"
    if not store.is_file():
        typer.echo(
            f"no registry at {store} (paths.root={cfg.paths.root} from the config, relative to {Path.cwd()}): run this "
            "where `draftsmith run` ran, or pass paths.root=DIR or --uri URI",
            err=True,
        )
        raise typer.Exit(1)
    return f"sqlite:///{store}", name


@registry_app.command("list", **OVERRIDES)
def registry_list(ctx: typer.Context, name: str = typer.Option(None, help=NAME_HELP), uri: str = typer.Option(None, help=URI_HELP)) -> None:
    """Every version with its kind, measured speedup, tau, alpha, K, quantization and why it was (not) promoted."""
    from rich.table import Table

    from draftsmith.pipeline.registry import list_versions

    uri, name = _registry(ctx, uri, name)
    rows = list_versions(uri, name)
    table = Table(title=f"registry: {name} ({uri})")
    columns = ("version", "champion", "kind", "speedup", "tau", "alpha", "k", "quantization", "gates_passed", "reason")
    for column in columns:
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(*(row[c] for c in columns))
    print_table(table)


@registry_app.command("promote", **OVERRIDES)
def registry_promote(
    ctx: typer.Context,
    version: str = typer.Argument(..., help="version to make champion"),
    name: str = typer.Option(None, help=NAME_HELP),
    uri: str = typer.Option(None, help=URI_HELP),
) -> None:
    """Make VERSION the champion by hand (the one it replaces is remembered for rollback)."""
    from draftsmith.pipeline.registry import RegistryError, promote

    uri, name = _registry(ctx, uri, name)
    try:
        promote(uri, name, version)
    except RegistryError as e:
        typer.echo(str(e), err=True)
        raise typer.Exit(1) from None
    typer.echo(f"{name}@champion -> version {version}")


@registry_app.command("rollback", **OVERRIDES)
def registry_rollback(
    ctx: typer.Context, name: str = typer.Option(None, help=NAME_HELP), uri: str = typer.Option(None, help=URI_HELP)
) -> None:
    """Point champion back at the version the current champion replaced."""
    from draftsmith.pipeline.registry import RegistryError, rollback

    uri, name = _registry(ctx, uri, name)
    try:
        version = rollback(uri, name)
    except RegistryError as e:
        typer.echo(str(e), err=True)
        raise typer.Exit(1) from None
    typer.echo(f"{name}@champion -> version {version}")


if __name__ == "__main__":
    main()
