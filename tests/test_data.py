"""Domain data: file formats, chat messages, the hash split, the demo prompt set."""

import json

import pandas as pd
import pytest

from draftsmith.distill.data import DataError, in_eval_split, prepare, read_records, to_messages
from draftsmith.distill.demo_prompts import generate
from draftsmith.pipeline.config import DataConfig

RECORDS = [{"id": f"r{i}", "prompt": f"How do I close account number {i}?"} for i in range(30)]


def config(path, **kw):
    return DataConfig(
        path=str(path), prompt_field=kw.get("prompt_field", "prompt"), eval_fraction=0.25, max_prompts=kw.get("max_prompts"), seed=0
    )


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet", "datasets"])
def test_formats_read_the_same_records(tmp_path, fmt):
    path = tmp_path / f"data.{fmt}"
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    elif fmt == "csv":
        pd.DataFrame(RECORDS).to_csv(path, index=False)
    elif fmt == "parquet":
        pd.DataFrame(RECORDS).to_parquet(path)
    else:
        import datasets

        datasets.Dataset.from_list(RECORDS).save_to_disk(str(path))
    assert [r["prompt"] for r in read_records(str(path))] == [r["prompt"] for r in RECORDS]


def test_split_is_by_content_not_order(tiny_chat_target, tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    rows = prepare(config(path), tiny_chat_target)
    path.write_text("".join(json.dumps(r) + "\n" for r in reversed(RECORDS)))
    again = prepare(config(path), tiny_chat_target)
    assert {r["id"]: r["split"] for r in rows} == {r["id"]: r["split"] for r in again}
    assert 0 < sum(r["split"] == "eval" for r in rows) < len(rows)
    # the target's chat template was applied: the prompt ends by opening the assistant's turn
    from transformers import AutoTokenizer

    text = AutoTokenizer.from_pretrained(tiny_chat_target).decode(rows[0]["prompt_ids"])
    assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n")


def test_messages_drop_trailing_assistant_turns():
    record = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    assert to_messages(record, "prompt") == [{"role": "user", "content": "hi"}]
    assert to_messages({"prompt": "  "}, "prompt") == []


def test_unusable_data_is_refused_and_unusable_records_said(tiny_chat_target, tmp_path, caplog):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"question": "no prompt field"}) + "\n")
    with pytest.raises(DataError, match="none of 1 records has a 'prompt' or 'messages' field"):
        prepare(config(path), tiny_chat_target)
    path.write_text("".join(json.dumps(r) + "\n" for r in [*RECORDS[:3], {"question": "no prompt field"}, {"prompt": " "}]))
    with caplog.at_level("WARNING", logger="draftsmith"):
        assert [r["id"] for r in prepare(config(path), tiny_chat_target)] == ["r0", "r1", "r2"]
    assert "2 of 5 records have no 'prompt' or 'messages' to prompt with; left out" in caplog.text
    (tmp_path / "data.txt").write_text("x")
    with pytest.raises(DataError, match="unsupported data file"):
        read_records(str(tmp_path / "data.txt"))
    for missing in (tmp_path / "gone.jsonl", tmp_path / "gone_dir", "~/gone.csv"):
        with pytest.raises(DataError, match=f"{missing}: no such file or directory"):
            read_records(str(missing))


def test_demo_prompt_set_is_varied_and_shipped():
    records = read_records("demo")
    assert len(records) >= 1000 and records == generate(1200, 0)  # the shipped file is the script's output
    assert len({r["kind"] for r in records}) >= 6 and len({r["tone"] for r in records}) == 5
    assert sum("messages" in r for r in records) > 100  # follow-up turns
    lengths = [len(r.get("prompt") or r["messages"][0]["content"]) for r in records]
    assert min(lengths) < 60 and max(lengths) > 180
    assert in_eval_split("x", 0.0, 0) is False and in_eval_split("x", 1.0, 0) is True
