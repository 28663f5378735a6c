"""The stage graph: the pipeline's stages in order, which of them exist, and running them."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from draftsmith.distill import data, stage as distill, teacher
from draftsmith.pipeline import target
from draftsmith.pipeline.config import DraftsmithConfig
from draftsmith.pipeline.stage import Stage, StageOutput, run_stage
from draftsmith.quantize import stage as quantize

# the whole data flow of DESIGN.md, in order
PIPELINE = ("target", "data", "teacher", "distill", "quantize", "evaluate", "publish", "registry")

BUILT: dict[str, Stage] = {stage.name: stage for stage in (target.STAGE, data.STAGE, teacher.STAGE, distill.STAGE,
                                                              quantize.STAGE)}


def not_built() -> list[str]:
    return [name for name in PIPELINE if name not in BUILT]


def run_pipeline(cfg: DraftsmithConfig, root: Path,
                 on_stage: Callable[[StageOutput], None] = lambda output: None) -> list[StageOutput]:
    """Run every built stage in order whose inputs exist; return their outputs."""
    outputs: dict[str, StageOutput] = {}
    for name in PIPELINE:
        stage = BUILT.get(name)
        if stage is None or any(i not in outputs for i in stage.inputs):
            continue
        outputs[name] = run_stage(stage, cfg, outputs, root)
        on_stage(outputs[name])
    return list(outputs.values())
