"""Greedy exact-match accuracy on a tiny randomly initialised model."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from shardforge.algorithms.demos.evaluation import exact_match_accuracy, greedy_answers
from shardforge.algorithms.testing.tiny import build_char_tokenizer


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


# Greedy answers are argmaxes: equal across batch shapes (padded vs not, other matmul kernels),
# thread counts and CPUs only if no step is a near tie. Rounding moves these logits by ~1e-6;
# every greedy step here wins by more than MIN_MARGIN, so the equality below holds by construction
# (a fixture change that creates a tie fails the margin check, not the padding check).
MIN_MARGIN = 1e-3


@torch.no_grad()
def _greedy_unpadded(model, tokenizer, prompt: str, steps: int) -> tuple[str, float, list[torch.Tensor]]:
    """Batch-1, unpadded greedy decoding by hand: the answer, its smallest top-1/top-2 margin and
    the logits of each step."""
    ids = [tokenizer.bos_token_id, *tokenizer(prompt, add_special_tokens=False)["input_ids"]]
    out, margin, logits = [], float("inf"), []
    for _ in range(steps):
        logits.append(model(input_ids=torch.tensor([ids])).logits[0, -1])
        top = logits[-1].topk(2)
        margin = min(margin, float(top.values[0] - top.values[1]))
        token = int(top.indices[0])
        if token == tokenizer.eos_token_id:
            break
        out.append(token)
        ids.append(token)
    return tokenizer.decode(out, skip_special_tokens=True).strip(), margin, logits


def test_greedy_answers_are_batch_independent(model_and_tokenizer, monkeypatch):
    model, tokenizer = model_and_tokenizer
    reference = [_greedy_unpadded(model, tokenizer, p, 3) for p in PROMPTS]
    assert min(m for _, m, _ in reference) > MIN_MARGIN, ("a greedy step is a near tie", reference)
    # The continuous quantity under the argmax: record the logits greedy_answers' batched,
    # left-padded generate sees and compare them with the unpadded ones (fp32, another batch
    # shape: rounding-level differences; a padding bug moves them by far more than 1e-4).
    seen: list[tuple[torch.Tensor, ...]] = []
    generate = model.generate

    def recording_generate(**kwargs):
        out = generate(**kwargs, output_logits=True, return_dict_in_generate=True)
        seen.append(out.logits)
        return out.sequences

    monkeypatch.setattr(model, "generate", recording_generate)
    together = greedy_answers(model, tokenizer, PROMPTS, max_new_tokens=3)
    for row, (_, _, logits) in enumerate(reference):
        for step, want in enumerate(logits):
            torch.testing.assert_close(seen[0][step][row], want, rtol=0, atol=1e-4, msg=f"{PROMPTS[row]} step {step}")
    monkeypatch.undo()
    alone = [greedy_answers(model, tokenizer, [p], max_new_tokens=3)[0] for p in PROMPTS]
    assert together == alone == [a for a, _, _ in reference]  # left padding does not change a prompt's answer
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
