"""The demo target on CPU: greedy speculative output equals the target's own, with a small draft."""

import pytest
import torch

from draftsmith.distill.draft import build_from_target, chosen_layers, every_nth_layer
from draftsmith.serve.engine import Engine, detokenizer_of, eos_ids_of
from draftsmith.serve.sampling import SamplingParams
from draftsmith.serve.weights import load_model

QUESTIONS = [
    "How do I dispute a charge on my credit card?",
    "What is the fee for an international wire transfer?",
    "My debit card was declined at the store, why?",
    "Can I raise my daily ATM withdrawal limit?",
]


@pytest.fixture(scope="module")
def demo_engines(demo_target_dir, tmp_path_factory):
    from transformers import AutoTokenizer

    draft_dir = build_from_target(demo_target_dir, tmp_path_factory.mktemp("demo-draft"), every_nth_layer(30, 4))
    tokenizer = AutoTokenizer.from_pretrained(demo_target_dir)
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)["input_ids"]
        for q in QUESTIONS
    ]
    # float64: the property checked is the algorithm's, free of 1-token vs K+1-token rounding differences
    target, draft = load_model(demo_target_dir, torch.float64), load_model(draft_dir, torch.float64)
    kwargs = dict(eos_token_ids=eos_ids_of(demo_target_dir), detokenize=detokenizer_of(demo_target_dir), max_seq_len=128)
    return prompts, Engine(target, draft, max_batch_size=4, **kwargs)


@pytest.mark.slow
def test_demo_target_greedy_speculative_equals_plain(demo_engines):
    prompts, engine = demo_engines
    params = SamplingParams(max_new_tokens=16)
    expected = [c.tokens for c in engine.generate(prompts, params).completions]
    assert all(len(t) == 16 for t in expected)
    for k in (1, 2, 5, 8):  # the tiny models' sweep covers every K; here the real model's numerics
        batch = engine.generate(prompts, params, num_speculative_tokens=k)  # batch 4
        assert [c.tokens for c in batch.completions] == expected, f"K={k} batch 4"
        alone = engine.generate(prompts[k % 4 : k % 4 + 1], params, num_speculative_tokens=k)  # batch 1
        assert alone.completions[0].tokens == expected[k % 4], f"K={k} batch 1"
        assert batch.stats.num_drafts > 0


def test_layer_choices_pick_the_target_layers_they_name():
    assert every_nth_layer(30, 4) == chosen_layers(30, 4, "spread") == [0, 10, 19, 29]
    assert every_nth_layer(30, 1) == [0]
    assert chosen_layers(30, 3, "first") == [0, 1, 2]
    assert chosen_layers(30, 3, "last") == [27, 28, 29]
    for choice in ("spread", "first", "last"):
        with pytest.raises(ValueError, match="between 1 and the target's 30 layers"):
            chosen_layers(30, 31, choice)
