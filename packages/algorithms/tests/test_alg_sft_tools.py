"""SFT on tool-call chat rows (HF format: assistant ``tool_calls``, ``tool`` messages, per-row ``tools``)
rendered by a Qwen3-style template that supports tools: the loss mask covers exactly the assistant
turns (tool-call text and <|im_end|> included; tool results, user turns and the system/tools block
not), the ids are the template's own rendering, and a short SFT run on such rows lowers the loss."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from shardforge.algorithms.config_io import build_config
from shardforge.algorithms.data import load_sft_examples, tokenize_sft_row
from shardforge.algorithms.trainers.sft import SFTConfig, run_sft
from shardforge.rollout.workflows.tools import calculator, tool_schema

TOOLS = [tool_schema(calculator)]


def _call(expression: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}


def _row(a: int, b: int) -> dict[str, Any]:
    return {
        "messages": [
            {"role": "user", "content": f"{a}+{b}="},
            {"role": "assistant", "content": "", "tool_calls": [_call(f"{a}+{b}")]},
            {"role": "tool", "name": "calculator", "content": str(a + b)},
            {"role": "assistant", "content": str(a + b)},
        ],
        "tools": TOOLS,
    }


# Two calls in one turn (two consecutive tool results: one user turn), reasoning on a turn before a
# later user query (Qwen3 drops it from the history) and a plain final answer after a second question.
LONG_ROW = {
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "1+2 and 3*4?"},
        {"role": "assistant", "content": "Both.", "reasoning_content": "two calls", "tool_calls": [
            _call("1+2"), {"type": "function", "function": {"name": "calculator", "arguments": '{"expression": "3*4"}'}},
        ]},
        {"role": "tool", "name": "calculator", "content": "3"},
        {"role": "tool", "name": "calculator", "content": "12"},
        {"role": "assistant", "content": "3 and 12"},
        {"role": "user", "content": "and 5-1?"},
        {"role": "assistant", "content": "", "tool_calls": [_call("5-1")]},
        {"role": "tool", "name": "calculator", "content": "4"},
        {"role": "assistant", "content": "<think>\nsubtracted\n</think>\n\n4"},
    ],
    "tools": TOOLS,
}  # fmt: skip

LONG_TARGETS = [
    'Both.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+2"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3*4"}}\n</tool_call><|im_end|>',
    "3 and 12<|im_end|>",
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "5-1"}}\n</tool_call><|im_end|>',
    "<think>\nsubtracted\n</think>\n\n4<|im_end|>",
]


@pytest.fixture(scope="module")
def chat(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from shardforge.algorithms.testing import QWEN3_TOOL_TEMPLATE, tiny_chat_assets

    return tiny_chat_assets(tmp_path_factory.mktemp("sft_tools"), seed=4, chat_template=QWEN3_TOOL_TEMPLATE)


def _spans(tokenizer: Any, ids: list[int], mask: list[float]) -> list[str]:
    """The decoded runs of consecutive target tokens."""
    spans, run = [], []
    for token, target in [*zip(ids, mask), (None, 0.0)]:
        if target:
            run.append(token)
        elif run:
            spans.append(tokenizer.decode(run, skip_special_tokens=False))
            run = []
    return spans


def test_loss_mask_is_exactly_the_assistant_turns(chat: dict[str, Any]) -> None:
    tokenizer = chat["tokenizer"]
    example = tokenize_sft_row(_row(12, 30), tokenizer)
    assert _spans(tokenizer, example.input_ids, example.loss_mask) == [
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12+30"}}\n</tool_call><|im_end|>',
        "<think>\n\n</think>\n\n42<|im_end|>",  # the last turn keeps Qwen3's (empty) think block
    ]
    full = tokenizer.apply_chat_template(_row(12, 30)["messages"], tools=TOOLS, tokenize=False)
    assert full.startswith(
        '<|im_start|>system\n# Tools\n<tools>\n{"type": "function", "function": {"name": "calculator"'
    )
    assert tokenizer.decode(example.input_ids, skip_special_tokens=False) == full  # nothing added or lost
    context = tokenizer.decode([t for t, m in zip(example.input_ids, example.loss_mask) if not m])
    assert "<tool_response>\n42\n</tool_response>" in context and "12+30=" in context


def test_history_rewrites_multiple_calls_and_tool_groups(chat: dict[str, Any]) -> None:
    tokenizer = chat["tokenizer"]
    example = tokenize_sft_row(LONG_ROW, tokenizer)
    assert _spans(tokenizer, example.input_ids, example.loss_mask) == LONG_TARGETS
    full = tokenizer.apply_chat_template(LONG_ROW["messages"], tools=TOOLS, tokenize=False)
    assert tokenizer.decode(example.input_ids, skip_special_tokens=False) == full
    assert "two calls" not in full  # reasoning before the last user query is dropped by the template
    assert (
        "<|im_start|>user\n<tool_response>\n3\n</tool_response>\n<tool_response>\n12\n</tool_response><|im_end|>"
        in full
    )


def test_rows_from_jsonl_and_errors(chat: dict[str, Any], tmp_path: Path) -> None:
    tokenizer = chat["tokenizer"]
    path = tmp_path / "tools.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [_row(1, 2), LONG_ROW]))
    examples = load_sft_examples(path, tokenizer)
    assert examples == [tokenize_sft_row(_row(1, 2), tokenizer), tokenize_sft_row(LONG_ROW, tokenizer)]
    bad_tools = dict(_row(1, 2), tools={"name": "calculator"})
    with pytest.raises(ValueError, match="r7: 'tools' must be a list of JSON schema objects"):
        tokenize_sft_row(bad_tools, tokenizer, where="r7")
    bad_calls = _row(1, 2)
    bad_calls["messages"][0]["tool_calls"] = [_call("1")]
    with pytest.raises(ValueError, match="message 0: 'tool_calls' must be a list on an assistant message"):
        tokenize_sft_row(bad_calls, tokenizer)


def test_short_sft_on_tool_rows_lowers_the_loss(chat: dict[str, Any], tmp_path: Path, monkeypatch) -> None:
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(_row(a, b)) + "\n" for a in range(0, 40, 3) for b in range(0, 40, 7)))
    config = build_config(
        SFTConfig,
        {
            "model": chat["model"], "output_dir": str(tmp_path / "out"), "layout": "d1", "steps": 12,
            "global_batch_size": 8, "progress": False, "export_hf_at_end": False, "loggers": ["jsonl"],
            "train_file": str(train),
            "engine": {"max_tokens_per_microbatch": 2048, "optimizer": {"lr": 3e-3}},
        },
    )  # fmt: skip
    run_sft(config)
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if r.get("split") == "train"]
    assert len(losses) == 12, rows
    # A random tiny model starts near ln(vocab) ~ 4.7 nats per target token (on the assistant tokens
    # only); 12 steps on rows of one format must clearly cut it (measured: 4.68 -> 3.59 mean of the last 3).
    assert sum(losses[-3:]) / 3 < 0.85 * losses[0] and losses[-1] < losses[-4], losses
