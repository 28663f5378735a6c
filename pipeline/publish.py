"""The publish stage: write the bundle (DESIGN.md) and verify it before it is moved into place.

Atomic by the stage contract: everything is written into the stage's work dir, which is renamed into
place only when complete, so a crash leaves no bundle behind.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
from pathlib import Path
from typing import Any, Mapping

from draftsmith.evaluate.report import PLOTS
from draftsmith.pipeline import bundle as bundles
from draftsmith.pipeline.config import DraftsmithConfig
from draftsmith.pipeline.stage import Stage, StageOutput
from draftsmith.pipeline.target import load_reference
from draftsmith.quantize.stage import draft_dir_of
from draftsmith.serve.eagle import is_eagle_dir, set_speculative_tokens
from draftsmith.serve.proposers import VOCAB_FILE

BUNDLE_DIR = "bundle"
_TARGET_FILES = ("*.json", "*.safetensors", "*.jinja", "*.txt", "*.model")  # an HF dir without pickles


def bundle_of(output: StageOutput) -> Path:
    return output.path / BUNDLE_DIR


def speculative_config(method: str, model: str, k: int, schedule: list[list[int]] | None) -> dict:
    """speculative_config.json: what vLLM takes, with the K-by-batch-size schedule (vLLM's dynamic speculation,
    num_speculative_tokens_per_batch_size) where it changes K at some batch size."""
    spec = {"method": method, "model": model, "num_speculative_tokens": k}
    if schedule and any(entry[2] != k for entry in schedule):
        spec["num_speculative_tokens_per_batch_size"] = schedule
    return spec


def serve_script(target: str, spec: dict, max_model_len: int) -> str:
    """serve.sh: vLLM by default, draftsmith's own runtime with `./serve.sh draftsmith`; TARGET=... overrides
    where the target is (a dir or a hub id)."""
    spec = json.dumps({**spec, "model": "@BUNDLE@/draft"})
    return "\n".join(
        [
            "#!/usr/bin/env bash",
            "# Serve the target with this bundle's draft, lossless. Usage: [TARGET=dir-or-hub-id] ./serve.sh [vllm|draftsmith] [args...]",
            "set -euo pipefail",
            'BUNDLE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"',
            'GIVEN="${TARGET:-}"',
            f'TARGET="${{TARGET:-{target}}}"',
            f"SPEC={shlex.quote(spec)}",
            'runtime="${1:-vllm}"; shift || true',
            'case "$runtime" in',
            f'  vllm) exec vllm serve "$TARGET" --max-model-len {max_model_len} --speculative-config "${{SPEC//@BUNDLE@/$BUNDLE}}" "$@" ;;',
            '  draftsmith) exec draftsmith serve "$BUNDLE" ${GIVEN:+--target "$GIVEN"} "$@" ;;',
            '  *) echo "usage: $0 [vllm|draftsmith] [args...]" >&2; exit 2 ;;',
            "esac",
            "",
        ]
    )


def vllm_command(bundle: Path, target: str, spec: dict, max_model_len: int) -> str:
    spec = json.dumps({**spec, "model": str(bundle / "draft")})
    return f"vllm serve {shlex.quote(target)} --max-model-len {max_model_len} --speculative-config {shlex.quote(spec)}"


def model_card(cfg: DraftsmithConfig, reference: dict, report: dict, distill: dict, quantize: dict, target: str, spec: dict) -> str:
    from draftsmith.evaluate.report import markdown

    if spec["method"] == bundles.EAGLE3:
        what = (
            f"An EAGLE-3 head ({cfg.draft.num_layers} decoder layer(s) on the target's hidden states, draft vocabulary "
            f"{distill.get('draft_vocab_size')}, speculators format) trained by draftsmith from the target's logits "
            f"({cfg.distill.loss.value}, {distill.get('train_tokens', '?')} training tokens, training-time test over "
            f"{cfg.draft.ttt_steps} steps). Not quantized: the head is one small layer, and AWQ is applied to standalone drafts only."
        )
        made = f"- Head: `draft=eagle3`, {cfg.draft.num_layers} layer(s), reading the target's layers {cfg.draft.aux_layers or 'early, middle, late (default)'}"
    else:
        what = (
            f"A {cfg.draft.num_layers}-layer draft distilled by draftsmith from the target's logits "
            f"({cfg.distill.loss.value}, {distill.get('train_tokens', '?')} training tokens), on the target's tokenizer, "
            f"{quantize.get('scheme', 'not quantized (bf16)')}."
        )
        made = f"- Draft: `draft.init={cfg.draft.init.value}`, {cfg.draft.num_layers} layers"
    lines = [
        f"# Speculative-decoding draft for {reference['name_or_path']}",
        "",
        what + " Speculative decoding with it is lossless: outputs follow the target's distribution exactly.",
        "",
        "## How it was made",
        "",
        f"- Target: `{reference['name_or_path']}` ({reference['num_hidden_layers']} layers, vocab {reference['vocab_size']})",
        made,
        f"- Held-out TVD to the target: {distill.get('tvd_initial', float('nan')):.4f} before distillation, "
        f"{distill.get('tvd_final', float('nan')):.4f} after"
        + (f", {quantize['tvd_after']:.4f} after quantization" if "tvd_after" in quantize else ""),
    ]
    if "size_mb_bf16" in quantize:
        lines.append(
            f"- Size: {quantize['size_mb_bf16']:.1f} MB in bf16, {quantize['size_mb_quantized']:.1f} MB quantized "
            f"({quantize['size_mb_bf16_without_embeddings']:.1f} / {quantize['size_mb_quantized_without_embeddings']:.1f} MB "
            "without embeddings)"
        )
    lines += [
        "",
        "## Serve",
        "",
        "```sh",
        "./serve.sh            # vLLM",
        "./serve.sh draftsmith # draftsmith's runtime",
        f"# or: vllm serve {target} --speculative-config '{json.dumps({**spec, 'model': '<bundle>/draft'})}'",
        "```",
        "",
        "## Acceptance on held-out domain prompts",
        "",
        *gate_warnings(report),
        markdown(report),
        "",
    ]
    lines += [f"![{name}]({name})" for name in PLOTS]
    return "\n".join(lines) + "\n"


ALERT_SHARE = 0.75  # the low-acceptance alert fires below this share of the acceptance the bundle measured


def alert_rules(report: dict) -> str:
    """The shipped Prometheus rules (serve/monitoring/alerts.yml) with the low-acceptance alert at this bundle's
    own acceptance: the served counters give accepted / drafted, which the evaluation measured at the bundle's K
    (greedy and sampled); the alert fires below ALERT_SHARE of the lower of the two (under adaptive K, steps with
    fewer drafts keep a larger share: the alert errs towards staying quiet)."""
    import re
    from importlib import resources

    from draftsmith.evaluate.report import rows_of

    k, shipped = report["num_speculative_tokens"], report["shipped"]
    measured = min(r[k]["acceptance_rate"] for t in report["temperatures"] if k in (r := rows_of(report, shipped, t)))
    rate = round(ALERT_SHARE * measured, 4)
    text = (resources.files("draftsmith.serve") / "monitoring" / "alerts.yml").read_text()
    text = re.sub(r"(draftsmith:spec_decode_num_draft_tokens_total\[5m\]\)\)) < [0-9.]+", rf"\1 < {rate:g}", text, count=1)
    return text.replace(
        "< 55% for 5 minutes",
        f"< {rate:.1%} for 5 minutes ({ALERT_SHARE:.0%} of the {measured:.1%} of drafts kept that this bundle's evaluation measured at K={k})",
    )


def gate_warnings(report: dict) -> list[str]:
    """The card's lines on gates that failed as warnings (the draft was published all the same)."""
    gates, speedup = report["gates"], report["speed"]["measured_speedup"][report["shipped"]][str(report["num_speculative_tokens"])]
    lines = []
    for name in gates.get("warnings", []):
        g = gates[name]
        lines.append(
            f"- **Warning**: {g['what']} is {g['value']:.4f}, below evaluate.{name} = {g['threshold']}. Published all the same "
            f"(evaluate.alpha_gate=warn): it measured {speedup:.2f}x plain decoding on {report['device']}. "
            "evaluate.alpha_gate=hard holds such a draft back."
        )
    return lines + [""] if lines else []


def link_or_copy(source: Path, dest: Path) -> None:
    """A hard link where the file system allows one (a target's weights are large), else a copy."""
    try:
        os.link(source, dest)
    except OSError:
        shutil.copy2(source, dest)


def run(cfg: DraftsmithConfig, inputs: Mapping[str, StageOutput], out: Path) -> dict[str, Any]:
    from draftsmith.evaluate.stage import EVAL_PROMPTS, with_gates

    evaluation = inputs["evaluate"]
    report = with_gates(cfg, evaluation)
    if not report["gates"]["passed"] and not cfg.publish.override_gates:
        raise ValueError("the evaluation gates failed; publish.override_gates=true publishes anyway")
    reference = load_reference(inputs["target"])
    bundle = out / BUNDLE_DIR
    shutil.rmtree(bundle, ignore_errors=True)  # a killed earlier attempt's leftovers
    bundle.mkdir()
    shutil.copytree(draft_dir_of(inputs["distill"], inputs["quantize"]), bundle / "draft")
    k = report["num_speculative_tokens"]
    method = bundles.EAGLE3 if is_eagle_dir(bundle / "draft") else bundles.METHOD
    if method == bundles.EAGLE3:  # vLLM defaults num_speculative_tokens to the head's proposal method
        set_speculative_tokens(bundle / "draft", k)
    if (vocab := inputs["distill"].path / VOCAB_FILE).is_file() and method == bundles.METHOD:
        shutil.copy2(vocab, bundle / VOCAB_FILE)  # beside draft/: vLLM loads every safetensors file in it
    if cfg.publish.include_target:
        (bundle / "target").mkdir()
        for pattern in _TARGET_FILES:
            for file in Path(reference["path"]).glob(pattern):
                link_or_copy(file, bundle / "target" / file.name)
        target = "$BUNDLE/target"
    else:  # the hub id where there is one, else the path the target came from; TARGET=... overrides it
        target = reference.get("hub_id") or reference["path"]
    (bundle / bundles.TARGET_JSON).write_text(json.dumps(reference, indent=2))
    spec = speculative_config(method, "draft", k, report.get("dynamic_k", {}).get("schedule"))
    (bundle / bundles.SPECULATIVE_CONFIG).write_text(json.dumps(spec, indent=2))
    draft_len = json.loads((bundle / "draft" / "config.json").read_text()).get("max_position_embeddings", 2048)
    max_model_len = min(cfg.serve.max_model_len, draft_len, reference.get("max_position_embeddings") or draft_len)
    (bundle / "serve.sh").write_text(serve_script(target, spec, max_model_len))
    (bundle / "serve.sh").chmod(0o755)
    (bundle / "eval.json").write_text(json.dumps(report, indent=2, sort_keys=True))
    (bundle / "alerts.yml").write_text(alert_rules(report))
    for name in PLOTS:
        shutil.copy2(evaluation.path / name, bundle / name)
    if (evaluation.path / EVAL_PROMPTS).is_file():  # what vLLM decodes to check the bundle (make vllm-check)
        shutil.copy2(evaluation.path / EVAL_PROMPTS, bundle / EVAL_PROMPTS)
    (bundle / "README.md").write_text(
        model_card(
            cfg,
            reference,
            report,
            inputs["distill"].metrics,
            inputs["quantize"].metrics,
            reference.get("hub_id") or reference["name_or_path"],
            spec,
        )
    )
    manifest = bundles.write_manifest(bundle)
    bundles.verify(bundle)
    return {
        "num_speculative_tokens": k,
        "method": method,
        "alpha": evaluation.metrics["alpha"],
        "tau": evaluation.metrics["tau"],
        "acceptance_rate": evaluation.metrics.get("acceptance_rate"),
        "measured_speedup": evaluation.metrics["measured_speedup"],
        "quantization": inputs["quantize"].metrics.get("scheme", "none"),
        "files": len(manifest["files"]),
        "size_mb": round(sum(f["size"] for f in manifest["files"].values()) / 1e6, 2),
        "max_model_len": max_model_len,
        "gates_overridden": not report["gates"]["passed"],
    }


STAGE = Stage(
    name="publish",
    config_keys=("publish", "serve.max_model_len", "evaluate.min_alpha", "evaluate.alpha_gate", "evaluate.max_tau_loss"),
    inputs=("target", "distill", "quantize", "evaluate"),
    run=run,
    artifacts=tuple(f"{BUNDLE_DIR}/{name}" for name in ("README.md", "eval.json", *PLOTS)),
)
