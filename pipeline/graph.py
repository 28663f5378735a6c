"""The stage graph: the pipeline's stages in DESIGN.md's order, and running them."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from draftsmith.distill import data, teacher
from draftsmith.distill import stage as distill
from draftsmith.evaluate import stage as evaluate
from draftsmith.pipeline import publish, registry, target
from draftsmith.pipeline.config import STAGE_NAMES, DraftsmithConfig
from draftsmith.pipeline.stage import Stage, StageOutput, check_stage, run_stage
from draftsmith.quantize import stage as quantize

STAGES: dict[str, Stage] = {
    stage.name: stage
    for stage in (target.STAGE, data.STAGE, teacher.STAGE, distill.STAGE, quantize.STAGE, evaluate.STAGE, publish.STAGE, registry.STAGE)
}
PIPELINE = tuple(STAGES)
assert PIPELINE == STAGE_NAMES, "pipeline/config.py's STAGE_NAMES must list the stages in order"


def run_pipeline(cfg: DraftsmithConfig, root: Path, on_stage: Callable[[StageOutput], None] = lambda output: None) -> list[StageOutput]:
    """Run the stages in order, up to and including cfg.stop_after; return their outputs."""
    outputs: dict[str, StageOutput] = {}
    for name, stage in STAGES.items():
        outputs[name] = run_stage(stage, cfg, outputs, root)
        on_stage(outputs[name])
        check_stage(stage, cfg, outputs[name])
        if name == cfg.stop_after:
            break
    return list(outputs.values())
