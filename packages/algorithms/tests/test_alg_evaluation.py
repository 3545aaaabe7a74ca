"""Greedy exact-match accuracy on a tiny randomly initialised model."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from shardforge.algorithms.demos.demo import build_char_tokenizer
from shardforge.algorithms.evaluation import exact_match_accuracy, greedy_answers


@pytest.fixture(scope="module")
def model_and_tokenizer(tmp_path_factory):
    tokenizer = build_char_tokenizer(tmp_path_factory.mktemp("tok"))
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config), tokenizer


PROMPTS = ["1+1=", "12+30=", "7+8=", "99+1="]


def test_greedy_answers_are_batch_independent(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    together = greedy_answers(model, tokenizer, PROMPTS, max_new_tokens=3)
    alone = [greedy_answers(model, tokenizer, [p], max_new_tokens=3)[0] for p in PROMPTS]
    assert together == alone  # left padding does not change a prompt's answer
    assert len(together) == len(PROMPTS) and all(isinstance(a, str) for a in together)


def test_exact_match_accuracy_counts_matches(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    answers = greedy_answers(model, tokenizer, PROMPTS, max_new_tokens=3)
    references = [f" {answers[0]} ", answers[1], answers[2] + "x", "wrong" + answers[3]]  # 2 of 4 match
    accuracy = exact_match_accuracy(model, tokenizer, PROMPTS, references, max_new_tokens=3)
    assert 0.0 <= accuracy <= 1.0
    assert accuracy == 0.5


def test_exact_match_accuracy_argument_errors(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    with pytest.raises(ValueError, match="2 prompts but 1 references"):
        exact_match_accuracy(model, tokenizer, ["1=", "2="], ["1"])
    with pytest.raises(ValueError, match="no prompts"):
        exact_match_accuracy(model, tokenizer, [], [])
