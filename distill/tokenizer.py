"""Shared-tokenizer enforcement: a draft must read and write exactly the target's tokens.

`adopt_target_tokenizer` gives a draft dir the target's tokenizer files; `check_same_tokenizer`
compares vocabulary size, every special token id, the chat template and a sample round trip, and
raises TokenizerMismatch naming what differs. Quantize and publish call it again on their outputs.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "generation_config.json",
)

SAMPLE = "Hello! How do I dispute a $1,234.56 charge?\n\tÜber naïve café 🙂 <|im_start|>user 12345"
SPECIAL = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")


def copy_tokenizer_files(source: Path, dest: Path) -> list[str]:
    """Copy the tokenizer files `source` has into `dest`; return their names."""
    copied = []
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, dest / name)
            copied.append(name)
    return copied


class TokenizerMismatch(ValueError):
    """The draft's tokenizer differs from the target's; speculative decoding would be wrong or refused."""


def _config_vocab(model_dir: Path) -> int | None:
    path = model_dir / "config.json"
    return json.loads(path.read_text()).get("vocab_size") if path.is_file() else None


def check_same_tokenizer(target_dir: Path, draft_dir: Path, template: bool = True) -> None:
    """TokenizerMismatch unless the draft reads and writes the target's tokens; `template`: the chat templates
    must be equal too (a pretrained draft's own template does not matter: it takes the target's files)."""
    from transformers import AutoTokenizer

    target, draft = AutoTokenizer.from_pretrained(target_dir), AutoTokenizer.from_pretrained(draft_dir)
    problems = []
    tv, dv = _config_vocab(target_dir), _config_vocab(draft_dir)
    if tv != dv:
        problems.append(f"config vocab_size {dv} in the draft != {tv} in the target")
    if len(target) != len(draft):
        problems.append(f"tokenizer size {len(draft)} in the draft != {len(target)} in the target")
    for name in SPECIAL:
        t, d = getattr(target, name), getattr(draft, name)
        if t != d:
            problems.append(f"{name.removesuffix('_id')} id {d} in the draft != {t} in the target")
    if template and target.chat_template != draft.chat_template:
        problems.append("the chat templates differ")
    t_ids, d_ids = target.encode(SAMPLE, add_special_tokens=False), draft.encode(SAMPLE, add_special_tokens=False)
    if t_ids != d_ids:
        problems.append(f"the sample text encodes differently ({len(d_ids)} draft tokens vs {len(t_ids)} target tokens)")
    elif draft.decode(d_ids) != target.decode(t_ids):
        problems.append("the sample text decodes differently")
    if problems:
        raise TokenizerMismatch(
            f"draft {draft_dir} does not share the target's tokenizer: "
            + "; ".join(problems)
            + " (draft.init=from_target builds a draft on the target's tokenizer)"
        )


def adopt_target_tokenizer(target_dir: Path, draft_dir: Path) -> None:
    """Give the draft the target's tokenizer files, then check that they agree."""
    copy_tokenizer_files(target_dir, draft_dir)
    check_same_tokenizer(target_dir, draft_dir)
