"""The bundle: what publish writes and what `draftsmith serve` and vLLM read (DESIGN.md).

    draft/  target.json or target/  speculative_config.json  serve.sh  eval.json  README.md  *.png
    [draft_vocab.json]  manifest.json (format version; sha256 and size of every other file)

draft/ is an HF model dir (method draft_model) or an EAGLE-3 head in the speculators format (method
eagle3). target.json names the target (its hub id or where it came from, its revision) and holds the
sha256 of its config, tokenizer and weight files, so that the bundle travels without the target and
is checked against whichever copy of it is given (`--target`).

`verify` lists every problem it finds, never a traceback: the manifest (missing, extra, changed files;
regular files only), the JSON files, the draft's weights against its config (safetensors headers and
tensor shapes; a head's weights, loaded), that a draft model shares the target's tokenizer and
vocabulary size or that a head's shape fits the target's, the target's files against target.json
(weights hashed unless quick), and speculative_config against vLLM's constraints.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from draftsmith.pipeline.stage import sha256_file
from draftsmith.pipeline.target import IDENTITY_FILES

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SPECULATIVE_CONFIG = "speculative_config.json"
TARGET_JSON = "target.json"
METHOD = "draft_model"  # vLLM's speculative method for a separate draft model
EAGLE3 = "eagle3"  # vLLM's method for an EAGLE-3 head in the speculators format
MAX_SPECULATIVE_TOKENS = 16  # beyond this a step's verification costs more than any draft recovers


class BundleError(ValueError):
    """A bundle that fails verification; the message lists every problem found."""


def bundle_files(bundle: Path) -> list[str]:
    return sorted(str(p.relative_to(bundle)) for p in bundle.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(bundle: Path) -> dict:
    manifest = {
        "format_version": FORMAT_VERSION,
        "files": {name: {"sha256": sha256_file(bundle / name), "size": (bundle / name).stat().st_size} for name in bundle_files(bundle)},
    }
    (bundle / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
    return manifest


def read_json(path: Path, problems: list[str], what: str | None = None) -> dict | None:
    """A JSON object from `path`, or None with the reason added to `problems`."""
    what = what or path.name
    if not path.is_file():
        problems.append(f"{what} is missing")
        return None
    try:
        value = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        problems.append(f"{what} is not valid JSON ({e})")
        return None
    if not isinstance(value, dict):
        problems.append(f"{what} is not a JSON object")
        return None
    return value


def target_dir_of(bundle: Path, target: str | Path | None = None) -> Path:
    """The target the bundle speculates for: `target` (a dir or a hub id) if given, else the bundle's own
    copy, else where target.json says it was at publish."""
    from draftsmith.pipeline.target import TargetError, resolve_target_dir

    if target is not None:
        path = Path(target).expanduser()
        if path.exists() or str(target).startswith((".", "/", "~")):
            return path
        from draftsmith.pipeline.config import TargetConfig

        try:  # a hub id: fetched like the target stage fetches one
            return resolve_target_dir(TargetConfig(name_or_path=str(target), cache_dir="~/.cache/draftsmith", gguf_file=None))
        except TargetError as e:
            raise BundleError(str(e)) from None
    if (bundle / "target" / "config.json").is_file():
        return bundle / "target"
    problems: list[str] = []
    reference = read_json(bundle / TARGET_JSON, problems)
    if reference is None:
        raise BundleError("; ".join(problems))
    return Path(reference.get("path", ""))


def _manifest_problems(bundle: Path) -> list[str]:
    problems = [
        f"{p.relative_to(bundle)} is a symbolic link: a bundle holds regular files only"
        for p in sorted(bundle.rglob("*"))
        if p.is_symlink()
    ]
    if not (bundle / MANIFEST).is_file():
        return problems + [f"{MANIFEST} is missing: not a draftsmith bundle, or publish did not finish"]
    manifest = read_json(bundle / MANIFEST, problems)
    if manifest is None:
        return problems
    if manifest.get("format_version") != FORMAT_VERSION:
        return problems + [f"manifest format_version {manifest.get('format_version')} != {FORMAT_VERSION}"]
    listed = manifest.get("files")
    if not isinstance(listed, dict):
        return problems + ['manifest.json has no "files" table']
    present = set(bundle_files(bundle))
    problems += [f"missing file: {name}" for name in sorted(set(listed) - present)]
    problems += [f"extra file not in the manifest: {name}" for name in sorted(present - set(listed))]
    for name in sorted(set(listed) & present):
        entry, file = listed[name], bundle / name
        if not isinstance(entry, dict) or file.stat().st_size != entry.get("size") or sha256_file(file) != entry.get("sha256"):
            problems.append(f"changed file: {name} (sha256 or size differs from the manifest)")
    return problems


def _target_problems(bundle: Path, target: Path, quick: bool) -> list[str]:
    reference = read_json(bundle / TARGET_JSON, [], TARGET_JSON) if (bundle / TARGET_JSON).is_file() else None
    if not (target / "config.json").is_file():
        named = f" (target.json names {reference.get('hub_id') or reference.get('name_or_path')})" if reference else ""
        return [
            f"target {target} is not a model dir{named}: pass the target with --target PATH_OR_HUB_ID, "
            "or publish with publish.include_target=true to ship a copy inside the bundle"
        ]
    if reference is None:
        return []
    recorded = {name: digest for name, digest in reference.get("sha256", {}).items() if name in IDENTITY_FILES}
    if not quick:
        recorded.update(reference.get("weights_sha256", {}))
    problems = []
    for name, digest in sorted(recorded.items()):
        if not (target / name).is_file():
            problems.append(f"target file {name} is missing from {target}")
        elif sha256_file(target / name) != digest:
            problems.append(f"target file {name} differs from the target the bundle was made for (sha256 in target.json)")
    return problems


def _context_of(*configs: dict) -> int | None:
    lengths = [c.get("max_position_embeddings") for c in configs if c.get("max_position_embeddings")]
    return min(lengths) if lengths else None


def _speculative_problems(bundle: Path, target_config: dict) -> list[str]:
    from draftsmith.serve.eagle import is_eagle_dir

    problems: list[str] = []
    spec = read_json(bundle / SPECULATIVE_CONFIG, problems)
    draft_config = read_json(bundle / "draft" / "config.json", problems, "draft/config.json")
    if spec is None or draft_config is None:
        return problems
    method = EAGLE3 if is_eagle_dir(bundle / "draft") else METHOD
    if spec.get("method") != method:
        problems.append(f"speculative_config method {spec.get('method')!r}: expected {method!r} for this draft")
    k = spec.get("num_speculative_tokens")
    context = _context_of(target_config, draft_config)
    if not isinstance(k, int) or isinstance(k, bool) or k <= 0:
        problems.append(f"speculative_config num_speculative_tokens={k!r}: vLLM needs a positive integer")
    elif k > MAX_SPECULATIVE_TOKENS or (context and k + 2 > context):
        problems.append(
            f"speculative_config num_speculative_tokens={k}: at most {MAX_SPECULATIVE_TOKENS}, and a step of "
            f"K + 1 tokens must leave room in the context ({context} tokens)"
        )
    problems += _schedule_problems(spec.get("num_speculative_tokens_per_batch_size"), k)
    if (bundle / str(spec.get("model", ""))).resolve() != (bundle / "draft").resolve():
        problems.append(f"speculative_config model {spec.get('model')!r} is not the bundle's draft/ dir")
    if method == EAGLE3:
        return problems + _head_problems(bundle / "draft", target_config)
    if draft_config.get("vocab_size") != target_config.get("vocab_size"):
        problems.append(
            f"draft vocab size {draft_config.get('vocab_size')} != target {target_config.get('vocab_size')}: "
            "vLLM refuses a draft with another vocabulary (distill.draft.init=from_target keeps it equal)"
        )
    draft_len, target_len = draft_config.get("max_position_embeddings"), target_config.get("max_position_embeddings")
    if draft_len and target_len and draft_len > target_len:
        problems.append(
            f"draft max_position_embeddings {draft_len} > target's {target_len}: vLLM caps max_model_len at the smaller of the two"
        )
    from draftsmith.serve.proposers import VOCAB_FILE

    if (bundle / VOCAB_FILE).is_file():
        vocab = read_json(bundle / VOCAB_FILE, problems)
        ids = vocab.get("token_ids") if vocab else None
        if vocab is not None and not (
            isinstance(ids, list)
            and ids
            and all(isinstance(i, int) for i in ids)
            and min(ids) >= 0
            and max(ids) < target_config.get("vocab_size", 0)
        ):
            problems.append(f"{VOCAB_FILE} must list token ids of the target's vocabulary")
    return problems + _ignore_problems(draft_config) + _weights_problems(bundle / "draft", draft_config)


def _schedule_problems(schedule, k) -> list[str]:
    """vLLM's dynamic speculation schedule, if any: [[first batch size, last, K], ...], the ranges in order
    from batch size 1, each K from 0 (plain decoding) to num_speculative_tokens (vLLM caps it there)."""
    if schedule is None:
        return []
    entries = schedule if isinstance(schedule, list) else []
    valid = bool(entries) and all(
        isinstance(e, list) and len(e) == 3 and all(isinstance(x, int) and not isinstance(x, bool) for x in e) for e in entries
    )
    if valid:
        ends = [0] + [e[1] for e in entries]
        valid = (
            entries[0][0] == 1
            and all(e[0] == ends[i] + 1 and e[0] <= e[1] for i, e in enumerate(entries))
            and all(0 <= e[2] <= (k if isinstance(k, int) else 0) for e in entries)
        )
    return (
        []
        if valid
        else [
            f"speculative_config num_speculative_tokens_per_batch_size={schedule!r}: vLLM reads "
            "[[first batch size, last, K], ...], ranges in order from 1, each K from 0 to num_speculative_tokens"
        ]
    )


def _ignore_problems(draft_config: dict) -> list[str]:
    """A quantized draft whose quantization_config.ignore names layers bare: vLLM builds the draft under a
    prefix of its own, so such a name matches nothing there and vLLM expects that layer packed."""
    ignore = (draft_config.get("quantization_config") or {}).get("ignore") or []
    bare = [name for name in ignore if not name.startswith("re:") and name != "lm_head"]
    if not bare:
        return []
    return [
        f"draft/config.json quantization_config.ignore names {len(bare)} layer(s) bare ({bare[0]!r}): vLLM builds the "
        "draft under its own prefix, matches none of them and fails to load their dense weights; quantize again "
        "with this draftsmith, which writes them as re: patterns"
    ]


def safetensors_header(path: Path) -> tuple[dict | None, str | None]:
    """A safetensors file's header {name: {dtype, shape, data_offsets}}, or None and what is wrong."""
    size = path.stat().st_size
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            return None, "shorter than a safetensors header"
        length = struct.unpack("<Q", raw)[0]
        if length > size - 8:
            return None, "truncated: its header says more bytes than the file has"
        try:
            header = json.loads(f.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError):
            return None, "not readable: its safetensors header is not valid JSON"
    end = max((t["data_offsets"][1] for name, t in header.items() if name != "__metadata__"), default=0)
    if 8 + length + end > size:
        return None, f"truncated: {size} bytes where its header needs {8 + length + end}"
    return header, None


def expected_shapes(config: dict) -> dict[str, list[int]]:
    """The tensor names and shapes of an HF checkpoint with this config.json, whatever its family: the model
    transformers builds for it, on the meta device (nothing allocated), less a tied LM head (not saved)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {key: value for key, value in config.items() if key not in ("quantization_config", "architectures", "transformers_version")}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**fields))
    shapes = {name: list(tensor.shape) for name, tensor in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    return shapes


def _weights_problems(draft: Path, config: dict) -> list[str]:
    """The draft model's safetensors against its config.json: readable, every tensor there, right shapes
    (a quantized Linear X is X.weight_packed with X.weight_shape)."""
    problems, tensors = [], {}
    files = sorted(draft.glob("*.safetensors"))
    if not files:
        return ["draft/ has no *.safetensors weights"]
    for file in files:
        header, wrong = safetensors_header(file)
        if wrong:
            problems.append(f"draft/{file.name} is {wrong}")
        else:
            tensors.update({name: (file, t["shape"]) for name, t in header.items() if name != "__metadata__"})
    if problems:
        return problems
    try:
        expected = expected_shapes(config)
    except (KeyError, ValueError, TypeError) as e:
        return [
            f"draft/config.json does not describe a model transformers can build: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
        ]
    for name, shape in sorted(expected.items()):
        base = name.removesuffix(".weight")
        if name in tensors:
            if tensors[name][1] != shape:
                problems.append(f"draft tensor {name} has shape {tensors[name][1]}, config.json says {shape}")
        elif f"{base}.weight_packed" in tensors and f"{base}.weight_shape" in tensors:
            from safetensors import safe_open

            with safe_open(str(tensors[f"{base}.weight_shape"][0]), framework="pt") as f:
                stored = f.get_tensor(f"{base}.weight_shape").tolist()
            if stored != shape:
                problems.append(f"draft tensor {base} (quantized) has shape {stored}, config.json says {shape}")
        else:
            problems.append(f"draft tensor {name} is missing (config.json has {config['num_hidden_layers']} layers)")
    layers = {int(n.split(".")[2]) for n in tensors if n.startswith("model.layers.")}
    extra = sorted(i for i in layers if i >= config["num_hidden_layers"])
    if extra:
        problems.append(f"draft weights hold layers {extra} beyond config.json's num_hidden_layers={config['num_hidden_layers']}")
    return problems[:8] + ([f"... and {len(problems) - 8} more tensor problems"] if len(problems) > 8 else [])


def _head_problems(head_dir: Path, target_config: dict) -> list[str]:
    """An EAGLE-3 head: its config, its weights against it, and its shape against the target's."""
    import torch

    from draftsmith.serve.eagle import fit_problems, load_head
    from draftsmith.serve.model import ModelShape

    for file in sorted(head_dir.glob("*.safetensors")):
        if (wrong := safetensors_header(file)[1]) is not None:
            return [f"EAGLE-3 head: draft/{file.name} is {wrong}"]
    try:
        head = load_head(head_dir, torch.float32, "cpu")
        target_args = ModelShape.of(target_config)  # any family: a target run through transformers too
    except Exception as e:  # noqa: BLE001 - whatever is wrong with the files, verify names it in one line
        return [f"EAGLE-3 head: {str(e).splitlines()[0] if str(e) else type(e).__name__}"]
    return [f"EAGLE-3 head does not fit the target: {p}" for p in fit_problems(head.args, head.shape, target_args)]


def verify(bundle: Path, target: str | Path | None = None, quick: bool = False) -> dict:
    """Check everything; return speculative_config, or raise BundleError listing every problem.
    target: another copy of the target (a dir or a hub id), checked against target.json; quick: do not
    hash the target's weights."""
    from draftsmith.distill.tokenizer import TokenizerMismatch, check_same_tokenizer
    from draftsmith.serve.eagle import is_eagle_dir

    bundle = Path(bundle)
    if not bundle.is_dir():
        raise BundleError(f"{bundle} is not a directory")
    problems = _manifest_problems(bundle)
    fail = lambda: BundleError(f"bundle {bundle} failed verification:\n  - " + "\n  - ".join(problems))
    if not (bundle / TARGET_JSON).is_file() and not (bundle / "target").is_dir() and target is None:
        problems.append(f"neither {TARGET_JSON} nor target/ is present")
        raise fail()
    try:
        target_dir = target_dir_of(bundle, target)
    except BundleError as e:
        problems.append(str(e))
        raise fail() from None
    problems += _target_problems(bundle, target_dir, quick)
    target_config = read_json(target_dir / "config.json", [], "the target's config.json") or {}
    if target_config:
        problems += _speculative_problems(bundle, target_config)
        if (bundle / "draft" / "config.json").is_file() and not is_eagle_dir(bundle / "draft"):
            try:  # a head has no tokenizer of its own: it reads the target's tokens
                check_same_tokenizer(target_dir, bundle / "draft")
            except (TokenizerMismatch, OSError, ValueError) as e:
                problems.append(f"tokenizer: {e}")
    if problems:
        raise fail()
    return json.loads((bundle / SPECULATIVE_CONFIG).read_text())
