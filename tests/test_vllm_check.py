"""The comparison `make vllm-check` makes between vLLM's own counters and eval.json (pipeline/vllm_check.py);
vLLM itself runs in its own venv, in CI after the suite (`.ci/run`), so here only what decides the verdict."""

from dataclasses import dataclass, field

import pytest

from draftsmith.pipeline.vllm_check import Unusable, derived, disagreements, expected_row, spec_counters


@dataclass
class Metric:  # the fields of vLLM's metric snapshot entries (vllm.v1.metrics.reader) that the check reads
    name: str
    value: int = 0
    values: list[int] = field(default_factory=list)


# an eval.json of format 2, whose rows named accepted / drafted "alpha" (format 3: "acceptance_rate")
REPORT = {
    "shipped": "w4a16",
    "acceptance": [
        {"proposer": "w4a16", "temperature": 0.0, "k": 2, "alpha": 0.39, "tau": 1.78, "acceptance_by_position": [0.478, 0.302]},
        {"proposer": "w4a16", "temperature": 0.7, "k": 2, "alpha": 0.30, "tau": 1.60, "acceptance_by_position": [0.4, 0.2]},
        {"proposer": "bf16", "temperature": 0.0, "k": 2, "alpha": 0.41, "tau": 1.82, "acceptance_by_position": [0.5, 0.32]},
    ],
}


def test_the_expected_row_is_the_shipped_draft_at_the_bundles_k_and_greedy():
    assert expected_row(REPORT, 2)["acceptance_by_position"] == [0.478, 0.302]
    with pytest.raises(Unusable, match="no T=0 row of 'w4a16' at K=3"):
        expected_row(REPORT, 3)


def test_vllm_counters_give_acceptance_by_position_rate_and_length():
    metrics = [
        Metric("vllm:spec_decode_num_drafts", 1000),
        Metric("vllm:spec_decode_num_draft_tokens", 2000),
        Metric("vllm:spec_decode_num_accepted_tokens", 763),
        Metric("vllm:spec_decode_num_accepted_tokens_per_pos", values=[474, 289]),
        Metric("vllm:num_requests_running", 0),
        Metric("vllm:generation_tokens", 5000),
    ]
    measured = derived(spec_counters(metrics))
    assert measured["acceptance_by_position"] == [0.474, 0.289]
    assert measured["acceptance_rate"] == pytest.approx(0.3815) and measured["tau"] == pytest.approx(1.763)
    assert disagreements(measured, expected_row(REPORT, 2), 0.03) == []


def test_a_disagreement_names_the_position_and_both_numbers():
    measured = {"acceptance_by_position": [0.474, 0.25]}
    assert disagreements(measured, expected_row(REPORT, 2), 0.03) == [
        "position 2: vLLM 0.2500, eval.json 0.3020 (difference -0.0520, tolerance 0.03)"
    ]
    assert disagreements({"acceptance_by_position": [0.5]}, expected_row(REPORT, 2), 0.03) == [
        "vLLM counted 1 draft positions, eval.json has 2"
    ]
    assert disagreements({"acceptance_by_position": []}, expected_row(REPORT, 2), 0.03)  # no drafts at all: disagrees


def test_a_k_schedule_is_checked_at_the_k_of_its_first_range():
    from draftsmith.pipeline.vllm_check import batch_and_k

    assert batch_and_k({"num_speculative_tokens": 3})[:2] == (None, 3)
    spec = {"num_speculative_tokens": 3, "num_speculative_tokens_per_batch_size": [[1, 15, 3], [16, 64, 1]]}
    assert batch_and_k(spec)[:2] == (15, 3) and batch_and_k(spec)[3] == spec  # at most 15 at once: every step at K=3
    # speculation off at small batches (a CPU where it never pays there): the bundle's K, without the schedule
    off = {"num_speculative_tokens": 3, "num_speculative_tokens_per_batch_size": [[1, 3, 0], [4, 64, 2]]}
    at_once, k, why, loaded = batch_and_k(off)
    assert (at_once, k, loaded) == (None, 3, {"num_speculative_tokens": 3}) and "turns speculation off at batch sizes 1-3" in why


def test_a_running_vllm_servers_counters_are_read_from_its_metrics_page():
    """`--url`: the counters of `vllm serve`'s /metrics (Prometheus text, as vLLM 0.24 writes it), summed over
    engines, positions in order whatever order the lines come in."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from draftsmith.pipeline.vllm_check import served_counters

    page = "\n".join(
        [
            "# TYPE vllm:spec_decode_num_drafts_total counter",
            'vllm:spec_decode_num_drafts_total{engine="0",model_name="t"} 600.0',
            'vllm:spec_decode_num_drafts_total{engine="1",model_name="t"} 400.0',
            'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="t"} 2000.0',
            'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="t"} 763.0',
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="t",position="1"} 289.0',
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="t",position="0"} 474.0',
            'vllm:spec_decode_num_accepted_tokens_per_pos_created{engine="0",model_name="t",position="0"} 1.7e9',
            'vllm:generation_tokens_total{engine="0",model_name="t"} 5000.0',
        ]
    )

    class Metrics(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(page.encode())

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        counters = served_counters(f"http://127.0.0.1:{server.server_port}")
    finally:
        server.shutdown()
    assert counters == {"num_drafts": 1000, "num_draft_tokens": 2000, "num_accepted_tokens": 763, "per_position": [474, 289]}
    assert derived(counters)["acceptance_by_position"] == [0.474, 0.289]


def test_a_draft_models_reduced_vocabulary_is_named_where_vllm_proposes_from_all_of_it(tmp_path):
    import json

    from draftsmith.pipeline.vllm_check import vocab_note

    assert vocab_note(tmp_path, {"method": "draft_model"}) is None
    (tmp_path / "draft_vocab.json").write_text(json.dumps({"size": 3, "token_ids": [5, 7, 9]}))
    assert "the 3 tokens of draft_vocab.json" in vocab_note(tmp_path, {"method": "draft_model"})
    assert vocab_note(tmp_path, {"method": "eagle3"}) is None  # a head's vocabulary mapping travels in its checkpoint


def test_a_running_server_with_a_schedule_that_turns_speculation_off_is_not_checked_against_it(tmp_path):
    import json

    from draftsmith.pipeline.vllm_check import check

    spec = {
        "method": "draft_model",
        "model": "draft",
        "num_speculative_tokens": 2,
        "num_speculative_tokens_per_batch_size": [[1, 3, 0], [4, 64, 2]],
    }
    (tmp_path / "speculative_config.json").write_text(json.dumps(spec))
    (tmp_path / "eval.json").write_text(json.dumps(REPORT))
    (tmp_path / "eval_prompts.json").write_text(json.dumps({"prompt_token_ids": [[1, 2, 3]], "max_new_tokens": 4}))
    # the server runs the schedule (no drafts at small batches): nothing to compare, and no request is sent
    with pytest.raises(Unusable, match="serve the bundle without it to check it"):
        check(tmp_path, None, 0.03, url="http://127.0.0.1:9")
