"""Tiny, locally built models, tokenizers and data for tests, benchmarks and examples.

One place for what every trainer test needs (no model hub): the demo's character tokenizer
(built with `tokenizers`, saved with ``save_pretrained``), a tiny Qwen3 initialised from a
config with a fixed seed and saved with ``save_pretrained`` (so the real loading code runs),
and the demo's addition data as JSONL. Use it from a pytest fixture:

    @pytest.fixture(scope="module")
    def assets(tmp_path_factory):
        return tiny_assets(tmp_path_factory.mktemp("grpo"), seed=11)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["CHAT_TEMPLATE", "QWEN3_TOOL_TEMPLATE", "digit_reward", "tiny_assets", "tiny_chat_assets"]


def tiny_assets(
    root: str | Path,
    *,
    seed: int = 0,
    hidden: int = 32,
    layers: int = 2,
    data: bool = True,
    max_operand: int = 20,
    num_eval: int = 16,
    data_seed: int = 2,
    tokenizer_dir: str = "tokenizer",
) -> dict[str, Any]:
    """Build a tokenizer, a tiny Qwen3 and (``data=True``) addition train/eval JSONL under ``root``.

    Returns ``{"root": Path, "tokenizer": tokenizer, "model": str (model dir), "train": Path,
    "eval": Path}`` (no train/eval without data). ``seed`` initialises the weights, ``data_seed``
    shuffles the data; ``tokenizer_dir="model"`` saves the tokenizer inside the model directory.
    """
    from shardforge.algorithms.testing.tiny import build_char_tokenizer, build_tiny_qwen3, make_addition_data

    root = Path(root)
    tokenizer = build_char_tokenizer(root / tokenizer_dir)
    build_tiny_qwen3(root / "model", tokenizer, hidden=hidden, layers=layers, seed=seed)
    assets: dict[str, Any] = {"root": root, "tokenizer": tokenizer, "model": str(root / "model")}
    if data:
        train, evaluation = make_addition_data(
            root / "data", max_operand=max_operand, num_eval=num_eval, seed=data_seed
        )
        assets |= {"train": train, "eval": evaluation}
    return assets


CHAT_SPECIALS = ["<pad>", "<bos>", "<|im_end|>", "<unk>", "<|im_start|>"]
CHAT_MARKERS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
# Qwen3-like, and deliberately not prefix-stable: an assistant turn is generated after
# "<|im_start|>assistant\n" but rendered in the history with an empty think block in front, so
# re-tokenising a rendered conversation gives other ids than the ones the engine produced.
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\ntools: {{ tools | map(attribute='function.name') | join(',') }}<|im_end|>\n"
    "{% endif %}{% for m in messages %}{% if m.role == 'assistant' %}"
    "<|im_start|>assistant\n<think></think>{{ m.content }}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>{{ m.content }}</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# Qwen3's own chat template with tools, cut down only where it is English prose (the instructions in
# the tools system message): the tools' JSON schemas in <tools>, assistant tool_calls rendered as
# <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>, consecutive tool results grouped in one
# user turn of <tool_response> blocks, and the think block (Qwen3's history rewrite) only on assistant
# turns after the last real user query that are last or carry reasoning.
QWEN3_TOOL_TEMPLATE = r"""
{%- if tools %}
  {{- '<|im_start|>system\n' }}
  {%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
  {{- '# Tools\n<tools>' }}
  {%- for tool in tools %}{{- '\n' }}{{- tool | tojson }}{%- endfor %}
  {{- '\n</tools><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
  {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
  {%- set index = (messages|length - 1) - loop.index0 %}
  {%- if ns.multi_step_tool and message.role == 'user' and message.content is string
        and not (message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
    {%- set ns.multi_step_tool = false %}
    {%- set ns.last_query_index = index %}
  {%- endif %}
{%- endfor %}
{%- for message in messages %}
  {%- set content = message.content if message.content is string else '' %}
  {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
    {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>\n' }}
  {%- elif message.role == 'assistant' %}
    {%- set reasoning = message.reasoning_content if message.reasoning_content is string else '' %}
    {%- if not reasoning and '</think>' in content %}
      {%- set reasoning = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
      {%- set content = content.split('</think>')[-1].lstrip('\n') %}
    {%- endif %}
    {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning) %}
      {{- '<|im_start|>assistant\n<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
    {%- else %}
      {{- '<|im_start|>assistant\n' + content }}
    {%- endif %}
    {%- for call in message.tool_calls or [] %}
      {%- if (loop.first and content) or not loop.first %}{{- '\n' }}{%- endif %}
      {%- if call.function %}{%- set call = call.function %}{%- endif %}
      {{- '<tool_call>\n{"name": "' + call.name + '", "arguments": ' }}
      {%- if call.arguments is string %}{{- call.arguments }}{%- else %}{{- call.arguments | tojson }}{%- endif %}
      {{- '}\n</tool_call>' }}
    {%- endfor %}
    {{- '<|im_end|>\n' }}
  {%- elif message.role == 'tool' %}
    {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
    {{- '\n<tool_response>\n' + content + '\n</tool_response>' }}
    {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
  {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""


def tiny_chat_assets(
    root: str | Path, *, seed: int = 0, hidden: int = 32, layers: int = 2, chat_template: str = CHAT_TEMPLATE
) -> dict[str, Any]:
    """A printable-ASCII character tokenizer with Qwen3-style chat markers (``<|im_start|>``,
    ``<|im_end|>`` = EOS, ``<tool_call>``, ...) and a chat template (default `CHAT_TEMPLATE`, not
    prefix-stable; `QWEN3_TOOL_TEMPLATE` renders tools and tool calls as Qwen3 does), plus a tiny
    Qwen3 over that vocabulary; for multi-turn / tool-use tests.

    Returns ``{"root": Path, "tokenizer": tokenizer, "model": str (model dir)}``.
    """
    import torch
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen3Config

    root = Path(root)
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {tok: i for i, tok in enumerate(CHAT_SPECIALS + CHAT_MARKERS + chars)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("(?m).|\n"), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CHAT_SPECIALS])
    core.add_tokens([AddedToken(t, special=False, normalized=False) for t in CHAT_MARKERS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<bos>", eos_token="<|im_end|>", unk_token="<unk>"
    )
    tokenizer.chat_template = chat_template
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=1024,
        tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(root / "model"))
    tokenizer.save_pretrained(str(root / "model"))
    return {"root": root, "tokenizer": tokenizer, "model": str(root / "model")}


def digit_reward(prompt: str, response: str, reference: str) -> float:
    """A reward that varies within a GRPO group even when a tiny random model never answers right
    (digits count 1, every character 0.1), so every step carries a gradient and changes the weights.
    ``reward_fn: shardforge.algorithms.testing:digit_reward``."""
    return float(sum(c.isdigit() for c in response)) + 0.1 * len(response)
