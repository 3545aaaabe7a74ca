"""Shared prefill on the embedded engine (`rollout.shared_prefill`): the samples of one prompt start from one
encoding of it, and sample what encoding every copy would (same tokens, log-probs up to float rounding)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shardforge.rollout import SamplingParams


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from shardforge.rollout.testing.tiny import tiny_model

    return tiny_model(tmp_path_factory.mktemp("shared_prefill"), seed=3)


def _fed_rows(engine: Any) -> list[tuple[int, int]]:
    """Record the ``[rows, columns]`` of every forward of the engine's model."""
    shapes: list[tuple[int, int]] = []

    def hook(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        shapes.append(tuple(kwargs["input_ids"].shape))

    engine.model.register_forward_pre_hook(hook, with_kwargs=True)
    return shapes


def test_groups_are_encoded_once_and_sample_as_if_each_copy_was(tiny: dict[str, Any]) -> None:
    from shardforge.rollout import HFRolloutEngine

    engine = HFRolloutEngine(tiny["model"], tiny["tokenizer"], share_prefill=True)
    unshared = HFRolloutEngine(tiny["model"], tiny["tokenizer"], share_prefill=False)
    shapes = _fed_rows(unshared)
    ids = [tiny["tokenizer"](t, add_special_tokens=False)["input_ids"] for t in ("1+2=", "13+29=", "7+7+7=")]
    width = max(len(p) for p in ids)
    params = SamplingParams(n=4, max_new_tokens=5, temperature=0.9, seed=11)
    plain = unshared.generate(ids, params)
    assert shapes[0] == (12, width)  # generate encodes all 3 x 4 rows
    shapes = _fed_rows(engine)
    shared = engine.generate(ids, params)
    # 3 distinct prompts over the first width - 1 columns, then generate feeds the 12 rows their last column.
    assert shapes[:2] == [(3, width - 1), (12, 1)]
    assert [r.response_ids for r in shared] == [r.response_ids for r in plain]
    for a, b in zip(shared, plain, strict=True):
        assert a.prompt_ids == b.prompt_ids and a.finished == b.finished
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)
    assert len({tuple(r.response_ids) for r in shared[:4]}) > 1, "the samples of one prompt still differ"
    # Greedy decoding too (no sampler): the same argmax path.
    greedy = SamplingParams(n=2, max_new_tokens=5, temperature=0.0)
    plain_greedy = unshared.generate(ids, greedy)
    assert [r.response_ids for r in engine.generate(ids, greedy)] == [r.response_ids for r in plain_greedy]


def test_nothing_is_shared_without_repeated_prompts(tiny: dict[str, Any]) -> None:
    from shardforge.rollout import HFRolloutEngine
    from shardforge.rollout.hf.shared_prefill import shared_prefill

    engine = HFRolloutEngine(tiny["model"], tiny["tokenizer"])
    ids = torch.tensor([[5, 6, 7], [5, 6, 8]])
    mask = torch.ones_like(ids)
    assert shared_prefill(engine.model, ids, mask, [(5, 6, 7), (5, 6, 8)]) is None  # n = 1: all distinct
    assert shared_prefill(engine.model, ids[:, :1], mask[:, :1], ["a", "a"]) is None  # one column: nothing before it
    cache = shared_prefill(engine.model, ids[[0, 0]], mask[[0, 0]], ["a", "a"])
    assert cache is not None and cache.layers[0].keys.shape[0] == 2 and cache.get_seq_length() == 2
    # Sliding-window layers keep a truncated cache that cannot be copied per row: not shared.
    engine.model.config.layer_types = ["sliding_attention"] * len(engine.model.config.layer_types)
    assert shared_prefill(engine.model, ids[[0, 0]], mask[[0, 0]], ["a", "a"]) is None
