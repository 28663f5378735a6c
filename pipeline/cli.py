"""The `draftsmith` command line."""
from __future__ import annotations

import sys

import typer

app = typer.Typer(help="draftsmith: distil, quantize, evaluate and serve speculative-decoding drafts.",
                  no_args_is_help=True, pretty_exceptions_enable=False)


@app.callback()
def cli() -> None:
    """draftsmith: distil, quantize, evaluate and serve speculative-decoding drafts."""


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def run(ctx: typer.Context) -> None:
    """Run the pipeline as a Hydra app: draftsmith run [-m] [key=value ...].

    Examples: `draftsmith run preset=gpu`, `draftsmith run -m distill.loss=tvd,jsd`.
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
