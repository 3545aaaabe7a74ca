"""SFT rows -> token ids + target masks (real char tokenizer), JSONL loading, the global batch sampler."""

from __future__ import annotations

import json
import sys

import pytest

from shardforge.algorithms.data import (
    GlobalBatchSampler,
    SFTExample,
    load_sft_examples,
    pack_examples,
    tokenize_sft_row,
)
from shardforge.algorithms.testing.tiny import build_char_tokenizer

# The char tokenizer's vocabulary: <pad> <bos> <eos> <unk>, then "0123456789+-*=? ".
BOS, EOS = 1, 2
ID = {c: 4 + i for i, c in enumerate("0123456789+-*=? ")}

# user: "?" + content + "=", assistant: content + <eos>, system: "*" + content + " ".
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}?{{ m['content'] }}="
    "{% elif m['role'] == 'assistant' %}{{ m['content'] }}{{ eos_token }}"
    "{% else %}*{{ m['content'] }} {% endif %}"
    "{% endfor %}"
)


def ids(text: str) -> list[int]:
    return [ID[c] for c in text]


@pytest.fixture
def tokenizer(tmp_path):
    return build_char_tokenizer(tmp_path / "tok")


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ------------------------------------------------------------------------------------------ prompt/completion
def test_prompt_completion_masks_only_completion_and_eos(tokenizer):
    example = tokenize_sft_row({"prompt": "12+3=", "completion": "15"}, tokenizer)
    assert example.input_ids == [BOS, *ids("12+3="), *ids("15"), EOS]
    assert example.loss_mask == [0.0] * 6 + [1.0] * 3


def test_none_valued_fields_count_as_absent(tokenizer):
    # datasets fills missing columns with None; a row with messages=None is still a prompt/completion row.
    example = tokenize_sft_row({"prompt": "1=", "completion": "1", "messages": None}, tokenizer)
    assert example.input_ids == [BOS, *ids("1="), *ids("1"), EOS]


@pytest.mark.parametrize(
    "row",
    [{"prompt": "1+1="}, {"completion": "2"}, {"text": "1+1=2"}, {"prompt": "1+1=", "completion": None}],
)
def test_malformed_row_names_row_and_expected_fields(tokenizer, row):
    with pytest.raises(ValueError) as info:
        tokenize_sft_row(row, tokenizer, where="row 7 of train.jsonl")
    message = str(info.value)
    assert message.startswith("row 7 of train.jsonl has fields")
    assert "expected 'prompt' + 'completion' (strings) or 'messages'" in message


def test_non_string_prompt_raises(tokenizer):
    with pytest.raises(ValueError, match="row 2: 'prompt' and 'completion' must be strings"):
        tokenize_sft_row({"prompt": 1, "completion": "2"}, tokenizer, where="row 2")


# ------------------------------------------------------------------------------------------ chat rows
def test_chat_rows_need_a_chat_template(tokenizer):
    assert tokenizer.chat_template is None
    row = {"messages": [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": "2"}]}
    with pytest.raises(ValueError, match="row 0: chat rows need a tokenizer with a chat_template"):
        tokenize_sft_row(row, tokenizer, where="row 0")


def test_chat_assistant_tokens_are_the_only_targets(tokenizer):
    tokenizer.chat_template = CHAT_TEMPLATE
    messages = [
        {"role": "system", "content": "0"},
        {"role": "user", "content": "1+1"},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "20+2"},
        {"role": "assistant", "content": "22"},
    ]
    example = tokenize_sft_row({"messages": messages}, tokenizer)
    parts = [
        (ids("*0 ") + ids("?1+1="), 0.0),
        ([*ids("2"), EOS], 1.0),
        (ids("?20+2="), 0.0),
        ([*ids("22"), EOS], 1.0),
    ]
    assert example.input_ids == [t for toks, _ in parts for t in toks]
    assert example.loss_mask == [m for toks, m in parts for _ in toks]
    # The whole conversation is exactly what the template renders.
    full = tokenizer.apply_chat_template(messages, tokenize=True)
    assert example.input_ids == list(full["input_ids"] if hasattr(full, "keys") else full)


def test_chat_without_assistant_raises(tokenizer):
    tokenizer.chat_template = CHAT_TEMPLATE
    with pytest.raises(ValueError, match="no assistant message"):
        tokenize_sft_row({"messages": [{"role": "user", "content": "1"}]}, tokenizer)


@pytest.mark.parametrize(
    ("messages", "pattern"),
    [
        ([], "'messages' must be a non-empty list"),
        ("1+1", "'messages' must be a non-empty list"),
        ([{"role": "user"}], "message 0 must have 'role' and 'content'"),
    ],
)
def test_malformed_messages_raise(tokenizer, messages, pattern):
    tokenizer.chat_template = CHAT_TEMPLATE
    with pytest.raises(ValueError, match=pattern):
        tokenize_sft_row({"messages": messages}, tokenizer)


def test_template_that_rewrites_earlier_turns_is_rejected(tokenizer):
    # Like templates that strip reasoning from earlier assistant turns: the first answer renders
    # as "0" once a later turn exists, so the prefix tokens change and cannot be spliced.
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'assistant' %}"
        "{% if loop.last %}{{ m['content'] }}{% else %}0{% endif %}{{ eos_token }}"
        "{% else %}?{{ m['content'] }}={% endif %}{% endfor %}"
    )
    messages = [
        {"role": "user", "content": "1+1"},
        {"role": "assistant", "content": "12"},
        {"role": "user", "content": "2+2"},
        {"role": "assistant", "content": "4"},
    ]
    assert tokenize_sft_row({"messages": messages[:2]}, tokenizer).input_ids == [*ids("?1+1=12"), EOS]
    with pytest.raises(ValueError, match="rewrites assistant message 1 once later messages follow"):
        tokenize_sft_row({"messages": messages}, tokenizer)


# ------------------------------------------------------------------------------------------ JSONL files
def test_load_sft_examples(tmp_path, tokenizer):
    rows = [
        {"prompt": "1+1=", "completion": "2"},
        {"prompt": "9+9=", "completion": "18"},
        {"prompt": "77+5=", "completion": "82"},
    ]
    path = _write_jsonl(tmp_path / "train.jsonl", rows)
    examples = load_sft_examples(path, tokenizer)  # one batched tokenizer call: each row keeps its own ids
    assert examples == [tokenize_sft_row(r, tokenizer) for r in rows]
    assert examples[1] == SFTExample([BOS, *ids("9+9=18"), EOS], [0.0] * 5 + [1.0] * 3)


def test_load_sft_examples_missing_file(tmp_path, tokenizer):
    with pytest.raises(FileNotFoundError, match=r"dataset file .*nope.jsonl' does not exist"):
        load_sft_examples(tmp_path / "nope.jsonl", tokenizer)


def test_load_sft_examples_names_the_bad_row(tmp_path, tokenizer):
    rows = [{"prompt": "1+1=", "completion": "2"}, {"prompt": "2+2="}]
    path = _write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(
        ValueError, match=r"bad.jsonl:2: the row has fields \['prompt'\]; expected 'prompt'\+'completion' or 'messages'"
    ):
        load_sft_examples(path, tokenizer)


def test_load_sft_examples_without_datasets_installed(tmp_path, tokenizer, monkeypatch):
    """`datasets` is optional at run time (GPU images without it): the JSONL reader falls back to json."""
    rows = [{"prompt": "1+1=", "completion": "2"}, {"messages": None, "prompt": "9+9=", "completion": "18"}]
    path = _write_jsonl(tmp_path / "train.jsonl", rows)
    with_datasets = load_sft_examples(path, tokenizer)
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    assert load_sft_examples(path, tokenizer) == with_datasets
    bad = _write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "1+1=", "completion": "2"}, {"prompt": "2+2="}])
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: the row has fields \['prompt'\]"):
        load_sft_examples(bad, tokenizer)
    (tmp_path / "broken.jsonl").write_text('{"prompt": "1=", "completion": "1"}\n{"prompt": \n')
    with pytest.raises(ValueError, match=r"broken\.jsonl:2: not valid JSON"):
        load_sft_examples(tmp_path / "broken.jsonl", tokenizer)


def test_load_sft_examples_truncates_with_a_warning(tmp_path, tokenizer):
    rows = [
        {"prompt": "1=", "completion": "1"},
        {"prompt": "11+11=", "completion": "22"},
        {"prompt": "1+1", "completion": "22"},
    ]
    path = _write_jsonl(tmp_path / "long.jsonl", rows)
    with pytest.warns(
        UserWarning,
        match="2 of 3 examples in long.jsonl truncated to max_seq_len=5 tokens; 1 of them lost every target token",
    ):
        examples = load_sft_examples(path, tokenizer, max_seq_len=5)
    assert len(examples) == 2  # the row whose completion was cut away entirely is skipped
    assert examples[0].input_ids == [BOS, *ids("1=1"), EOS]  # 5 tokens: kept as is
    assert examples[1].input_ids == [BOS, *ids("1+12")]
    assert examples[1].loss_mask == [0.0] * 4 + [1.0]  # cut, but a target token is left


def test_load_sft_examples_refuses_when_truncation_empties_every_row(tmp_path, tokenizer):
    path = _write_jsonl(tmp_path / "long.jsonl", [{"prompt": "11+11=", "completion": "22"}])
    with pytest.raises(ValueError, match=r"all 1 rows of .* lose every target token .* max_seq_len=5"):
        load_sft_examples(path, tokenizer, max_seq_len=5)


def test_pack_examples_follows_indices(tokenizer):
    examples = [SFTExample([1, 2, 3], [0, 1, 1]), SFTExample([4, 5], [0, 1])]
    batch = pack_examples(examples, [1, 0])
    assert batch.input_ids.tolist() == [4, 5, 1, 2, 3]
    assert batch.loss_mask.tolist() == [0, 1, 0, 1, 1]


# ------------------------------------------------------------------------------------------ sampler
def test_sampler_is_deterministic_and_seed_dependent():
    a = GlobalBatchSampler(10, 4, seed=3)
    b = GlobalBatchSampler(10, 4, seed=3)
    c = GlobalBatchSampler(10, 4, seed=4)
    assert [a.global_batch(s) for s in range(6)] == [b.global_batch(s) for s in range(6)]
    assert [a.global_batch(s) for s in range(6)] != [c.global_batch(s) for s in range(6)]


def test_sampler_epochs_are_permutations():
    sampler = GlobalBatchSampler(7, 7, seed=0)
    epochs = [sampler.global_batch(step) for step in range(4)]
    assert all(sorted(e) == list(range(7)) for e in epochs)
    assert len({tuple(e) for e in epochs}) > 1, "epochs are reshuffled"


def test_sampler_batches_straddle_epochs():
    sampler = GlobalBatchSampler(5, 3, seed=1)
    stream = [i for step in range(5) for i in sampler.global_batch(step)]  # 15 items = 3 epochs
    for epoch in range(3):
        assert sorted(stream[epoch * 5 : (epoch + 1) * 5]) == list(range(5))


def test_sampler_without_shuffle_is_in_order():
    sampler = GlobalBatchSampler(5, 3, shuffle=False)
    assert [sampler.global_batch(s) for s in range(3)] == [[0, 1, 2], [3, 4, 0], [1, 2, 3]]


@pytest.mark.parametrize("dp_size", [1, 2, 3, 6])
def test_local_batches_partition_the_global_batch(dp_size):
    sampler = GlobalBatchSampler(20, 6, seed=0)
    for step in range(5):
        local = [sampler.local_batch(step, rank, dp_size) for rank in range(dp_size)]
        assert sorted(i for part in local for i in part) == sorted(sampler.global_batch(step))
        assert {len(part) for part in local} == {6 // dp_size}


def test_resuming_at_step_k_yields_the_same_batches():
    first = GlobalBatchSampler(9, 4, seed=5)
    run = [first.global_batch(step) for step in range(12)]
    resumed = GlobalBatchSampler(9, 4, seed=5)
    assert [resumed.global_batch(step) for step in range(7, 12)] == run[7:]
    # Resuming with another data-parallel size reads the same global batches.
    assert [resumed.local_batch(step, 1, 2) for step in range(7, 12)] == [b[1::2] for b in run[7:]]


def test_sampler_answers_earlier_steps_after_later_ones():
    sampler = GlobalBatchSampler(4, 3, seed=2)
    late = sampler.global_batch(10)  # epochs 7 and 8 cached
    early = sampler.global_batch(0)  # epoch 0 must not be evicted as soon as it is made
    fresh = GlobalBatchSampler(4, 3, seed=2)
    assert early == fresh.global_batch(0)
    assert late == fresh.global_batch(10)


def test_global_batch_smaller_than_dp_size_raises():
    with pytest.raises(ValueError, match="global batch size 2 is smaller than the data-parallel size 4"):
        GlobalBatchSampler(10, 2).local_batch(0, 0, 4)


def test_sampler_argument_errors():
    with pytest.raises(ValueError, match="the dataset is empty"):
        GlobalBatchSampler(0, 2)
    with pytest.raises(ValueError, match="global batch size must be >= 1"):
        GlobalBatchSampler(3, 0)
