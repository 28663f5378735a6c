"""The bundle: what publish writes and what `draftsmith serve` and vLLM read (DESIGN.md).

    draft/  target.json or target/  speculative_config.json  serve.sh  eval.json  README.md  *.png
    [draft_vocab.json]  manifest.json (format version; sha256 and size of every other file)

draft/ is an HF model dir (method draft_model) or an EAGLE-3 head in the speculators format (method
eagle3). `verify` checks the manifest (missing, extra, changed files), that a draft model shares the
target's tokenizer and vocabulary size or that a head's weights match its config and its shape the
target's, and speculative_config against vLLM's constraints.
"""
from __future__ import annotations

import json
from pathlib import Path

from draftsmith.pipeline.target import IDENTITY_FILES, sha256_file

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SPECULATIVE_CONFIG = "speculative_config.json"
TARGET_JSON = "target.json"
METHOD = "draft_model"  # vLLM's speculative method for a separate draft model
EAGLE3 = "eagle3"  # vLLM's method for an EAGLE-3 head in the speculators format


class BundleError(ValueError):
    """A bundle that fails verification; the message lists every problem found."""


def bundle_files(bundle: Path) -> list[str]:
    return sorted(str(p.relative_to(bundle)) for p in bundle.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(bundle: Path) -> dict:
    manifest = {"format_version": FORMAT_VERSION,
                "files": {name: {"sha256": sha256_file(bundle / name), "size": (bundle / name).stat().st_size}
                          for name in bundle_files(bundle)}}
    (bundle / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
    return manifest


def target_dir_of(bundle: Path) -> Path:
    """The target the bundle speculates for: its own copy, or the referenced local dir."""
    if (bundle / "target" / "config.json").is_file():
        return bundle / "target"
    return Path(json.loads((bundle / TARGET_JSON).read_text())["path"])


def _manifest_problems(bundle: Path) -> list[str]:
    path = bundle / MANIFEST
    if not path.is_file():
        return [f"{path} is missing: not a draftsmith bundle, or publish did not finish"]
    manifest = json.loads(path.read_text())
    if manifest.get("format_version") != FORMAT_VERSION:
        return [f"manifest format_version {manifest.get('format_version')} != {FORMAT_VERSION}"]
    listed, present = manifest["files"], set(bundle_files(bundle))
    problems = [f"missing file: {name}" for name in sorted(set(listed) - present)]
    problems += [f"extra file not in the manifest: {name}" for name in sorted(present - set(listed))]
    for name in sorted(set(listed) & present):
        entry, file = listed[name], bundle / name
        if file.stat().st_size != entry["size"] or sha256_file(file) != entry["sha256"]:
            problems.append(f"changed file: {name} (sha256 or size differs from the manifest)")
    return problems


def _target_problems(bundle: Path, target: Path) -> list[str]:
    if not (target / "config.json").is_file():
        return [f"target {target} is not a model dir (publish.include_target=true ships a copy inside the bundle)"]
    reference = bundle / TARGET_JSON
    if not reference.is_file():
        return []
    recorded = json.loads(reference.read_text()).get("sha256", {})
    return [f"target file {name} changed since publish (sha256 differs from target.json)"
            for name, digest in recorded.items() if name in IDENTITY_FILES and (target / name).is_file()
            and sha256_file(target / name) != digest]


def _speculative_problems(bundle: Path, target: Path) -> list[str]:
    from draftsmith.serve.eagle import is_eagle_dir

    path = bundle / SPECULATIVE_CONFIG
    if not path.is_file():
        return [f"{SPECULATIVE_CONFIG} is missing"]
    spec = json.loads(path.read_text())
    problems = []
    method = EAGLE3 if is_eagle_dir(bundle / "draft") else METHOD
    if spec.get("method") != method:
        problems.append(f"speculative_config method {spec.get('method')!r}: expected {method!r} for this draft")
    k = spec.get("num_speculative_tokens")
    if not isinstance(k, int) or isinstance(k, bool) or k <= 0:
        problems.append(f"speculative_config num_speculative_tokens={k!r}: vLLM needs a positive integer")
    if (bundle / str(spec.get("model", ""))).resolve() != (bundle / "draft").resolve():
        problems.append(f"speculative_config model {spec.get('model')!r} is not the bundle's draft/ dir")
    target_config = json.loads((target / "config.json").read_text())
    if method == EAGLE3:
        return problems + _head_problems(bundle / "draft", target_config)
    draft_config = json.loads((bundle / "draft" / "config.json").read_text())
    if draft_config.get("vocab_size") != target_config.get("vocab_size"):
        problems.append(f"draft vocab size {draft_config.get('vocab_size')} != target {target_config.get('vocab_size')}: "
                        "vLLM refuses a draft with another vocabulary (distill.draft.init=from_target keeps it equal)")
    draft_len, target_len = draft_config.get("max_position_embeddings"), target_config.get("max_position_embeddings")
    if draft_len and target_len and draft_len > target_len:
        problems.append(f"draft max_position_embeddings {draft_len} > target's {target_len}: vLLM caps max_model_len "
                        "at the smaller of the two")
    from draftsmith.serve.proposers import VOCAB_FILE, read_vocab

    if (ids := read_vocab(bundle)) is not None and (not ids or min(ids) < 0 or max(ids) >= target_config.get("vocab_size", 0)):
        problems.append(f"{VOCAB_FILE} names token ids outside the target's vocabulary")
    return problems


def _head_problems(head_dir: Path, target_config: dict) -> list[str]:
    """An EAGLE-3 head: its config, its weights against it, and its shape against the target's."""
    import torch

    from draftsmith.serve.eagle import EagleFormatError, fit_problems, load_head
    from draftsmith.serve.model import ModelArgs, UnsupportedModelError

    try:
        head = load_head(head_dir, torch.float32, "cpu")
        target_args = ModelArgs.from_hf_config(target_config)
    except (EagleFormatError, UnsupportedModelError, OSError, ValueError) as e:
        return [f"EAGLE-3 head: {e}"]
    return [f"EAGLE-3 head does not fit the target: {p}" for p in fit_problems(head.args, head.shape, target_args)]


def verify(bundle: Path) -> dict:
    """Check everything; return speculative_config, or raise BundleError listing every problem."""
    from draftsmith.distill.tokenizer import TokenizerMismatch, check_same_tokenizer

    bundle = Path(bundle)
    if not bundle.is_dir():
        raise BundleError(f"{bundle} is not a directory")
    from draftsmith.serve.eagle import is_eagle_dir

    problems = _manifest_problems(bundle)
    if not (bundle / "draft" / "config.json").is_file():
        problems.append("draft/config.json is missing")
        raise BundleError(f"bundle {bundle} failed verification:\n  - " + "\n  - ".join(problems))
    target = target_dir_of(bundle) if (bundle / TARGET_JSON).is_file() or (bundle / "target").is_dir() else None
    if target is None:
        problems.append(f"neither {TARGET_JSON} nor target/ is present")
    else:
        problems += _target_problems(bundle, target)
        if (target / "config.json").is_file():
            problems += _speculative_problems(bundle, target)
            if not is_eagle_dir(bundle / "draft"):  # a head has no tokenizer of its own: it reads the target's tokens
                try:
                    check_same_tokenizer(target, bundle / "draft")
                except (TokenizerMismatch, OSError, ValueError) as e:
                    problems.append(f"tokenizer: {e}")
    if problems:
        raise BundleError(f"bundle {bundle} failed verification:\n  - " + "\n  - ".join(problems))
    return json.loads((bundle / SPECULATIVE_CONFIG).read_text())
