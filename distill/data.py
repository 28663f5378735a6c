"""The data stage: domain prompts in, tokenized chat prompts with a held-out split out (Arrow).

Sources: "demo" (the finance customer-service prompts that ship with draftsmith), a JSONL, CSV or
Parquet file, a `datasets` directory (save_to_disk), or a hub dataset id. Each record has a prompt
(`data.prompt_field`) or chat `messages`. The target's chat template is applied. A record belongs to
the held-out eval split when the hash of its text falls under `data.eval_fraction`; the split does
not depend on the order or number of records, and the eval ids are recorded in stage.json.
"""

from __future__ import annotations

import hashlib
import json
import logging
from importlib import resources
from pathlib import Path
from typing import Any, Mapping

from draftsmith.pipeline.config import DataConfig, DraftsmithConfig, missing_data
from draftsmith.pipeline.stage import Stage, StageOutput
from draftsmith.pipeline.target import load_reference
from draftsmith.serve.protocol import chat_token_ids

log = logging.getLogger("draftsmith")

PROMPTS_DIR = "prompts"


class DataError(ValueError):
    """The domain data cannot be read or has no usable records; the message says which and why."""


def demo_prompts_path() -> Path:
    return Path(str(resources.files("draftsmith.distill") / "data" / "finance_prompts.jsonl"))


def read_records(path: str) -> list[dict[str, Any]]:
    """Records from a file, a datasets dir or a hub dataset id."""
    if missing_data(path):
        raise DataError(f"{path}: no such file or directory")
    if path == "demo":
        path = str(demo_prompts_path())
    p = Path(path).expanduser()
    if p.suffix == ".jsonl":
        try:
            return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
        except json.JSONDecodeError as e:
            raise DataError(f"{p}: line {e.lineno - 0} is not JSON ({e.msg})") from None
    if p.suffix in (".csv", ".parquet"):
        import pandas as pd

        frame = pd.read_csv(p) if p.suffix == ".csv" else pd.read_parquet(p)
        return frame.to_dict("records")
    import datasets

    if p.is_dir():
        loaded = datasets.load_from_disk(str(p))
        if isinstance(loaded, datasets.DatasetDict):
            loaded = loaded["train"] if "train" in loaded else next(iter(loaded.values()))
        return loaded.to_list()
    if p.exists():
        raise DataError(f"{p}: unsupported data file (use .jsonl, .csv, .parquet or a datasets directory)")
    try:
        return datasets.load_dataset(path, split="train").to_list()
    except Exception as e:
        raise DataError(
            f"could not load data {path!r} ({type(e).__name__}): pass a local .jsonl/.csv/.parquet file or a datasets directory"
        ) from None


def to_messages(record: Mapping[str, Any], prompt_field: str) -> list[dict[str, str]]:
    if isinstance(record.get("messages"), list) and record["messages"]:
        messages = [{"role": m["role"], "content": m["content"]} for m in record["messages"]]
        while messages and messages[-1]["role"] == "assistant":  # the target writes the next assistant turn
            messages.pop()
        return messages
    text = record.get(prompt_field)
    return [{"role": "user", "content": text}] if isinstance(text, str) and text.strip() else []


def in_eval_split(key: str, fraction: float, seed: int) -> bool:
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def heldout_messages(path: str = "demo", prompt_field: str = "prompt", fraction: float = 0.1, seed: int = 0) -> list[list[dict]]:
    """The chat messages of the records the data stage puts in the held-out split (same defaults)."""
    chats = [to_messages(r, prompt_field) for r in read_records(path)]
    return [m for m in chats if m and in_eval_split(json.dumps(m, sort_keys=True), fraction, seed)]


def prepare(cfg: DataConfig, target_dir: Path) -> list[dict[str, Any]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    if tokenizer.chat_template is None:
        raise DataError(f"the target's tokenizer in {target_dir} has no chat template to format prompts with")
    records = read_records(cfg.path)
    rows, skipped = [], 0
    for i, record in enumerate(records):
        messages = to_messages(record, cfg.prompt_field)
        if not messages:
            skipped += 1
            continue
        key = json.dumps(messages, sort_keys=True)
        ids = chat_token_ids(tokenizer, messages)
        rows.append(
            {
                "id": str(record.get("id", f"record-{i}")),
                "messages": key,
                "prompt_ids": ids,
                "split": "eval" if in_eval_split(key, cfg.eval_fraction, cfg.seed) else "train",
            }
        )
    if not rows:
        raise DataError(f"{cfg.path}: none of {len(records)} records has a '{cfg.prompt_field}' or 'messages' field")
    if skipped:
        log.warning(
            "%s: %d of %d records have no '%s' or 'messages' to prompt with; left out", cfg.path, skipped, len(records), cfg.prompt_field
        )
    if cfg.max_prompts is not None:  # cap each split in proportion, keeping the split itself unchanged
        eval_rows = [r for r in rows if r["split"] == "eval"]
        train_rows = [r for r in rows if r["split"] == "train"]
        n_eval = max(1, round(cfg.max_prompts * cfg.eval_fraction))
        rows = train_rows[: cfg.max_prompts - n_eval] + eval_rows[:n_eval]
    return rows


def run(cfg: DraftsmithConfig, inputs: Mapping[str, StageOutput], out: Path) -> dict[str, Any]:
    import datasets

    rows = prepare(cfg.data, Path(load_reference(inputs["target"])["path"]))
    datasets.Dataset.from_list(rows).save_to_disk(str(out / PROMPTS_DIR))
    eval_ids = sorted(r["id"] for r in rows if r["split"] == "eval")
    (out / "eval_ids.json").write_text(json.dumps(eval_ids))
    lengths = [len(r["prompt_ids"]) for r in rows]
    return {
        "num_train": len(rows) - len(eval_ids),
        "num_eval": len(eval_ids),
        "eval_ids_sha256": hashlib.sha256(json.dumps(eval_ids).encode()).hexdigest(),
        "mean_prompt_tokens": round(sum(lengths) / len(lengths), 1),
        "max_prompt_tokens": max(lengths),
    }


def load_prompts(output: StageOutput):
    import datasets

    return datasets.load_from_disk(str(output.path / PROMPTS_DIR))


def data_identity(cfg: DraftsmithConfig) -> dict[str, Any]:
    path = demo_prompts_path() if cfg.data.path == "demo" else Path(cfg.data.path).expanduser()
    if path.is_file():
        return {"sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    return {}


STAGE = Stage(name="data", config_keys=("data",), inputs=("target",), run=run, identity=data_identity)
