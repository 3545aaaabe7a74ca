"""Tensor and Ulysses context parallelism for vision-language models (`engine/vision_tp.py`), world 2 vs
one process: t2 on tiny Qwen3-VL (sequence parallel: the language model's input and DeepStack's inputs
are cut per rank after the image features are scattered in) and Qwen2.5-VL (without SP), c2 on Qwen3-VL
(input, mRoPE positions and DeepStack inputs cut per CP rank after the merge). Each: the same log-probs on
image rows and on a text-only row (dummy image + padding to the token multiple), the same losses and the
same trained weights (vision tower included) after SFT steps whose loss also uses the entropy
(vocab-parallel under TP, gathered under CP). Refusals: PP/EP, CP x TP, a vocabulary tp does not divide."""

from __future__ import annotations

from typing import Any

import pytest

from shardforge.algorithms.testing.vlm import check_vlm_parity, vlm_tp_steps
from shardforge.mesh.testing import get_rank_pool


@pytest.fixture(autouse=True)
def _single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


def _assets(root: Any, family: str) -> dict[str, Any]:
    from shardforge.algorithms.testing.vlm import tiny_vlm_assets

    # vocab 112 (the tokenizer has 105 tokens): tp=2 splits the embedding and the LM head.
    return tiny_vlm_assets(root, seed=1, num_train=4, num_eval=1, family=family, vocab_size=112)


@pytest.mark.parametrize(
    ("family", "sequence_parallel"), [("qwen2_5_vl", False), ("qwen3_vl", True)], ids=["qwen2_5_vl", "qwen3_vl-sp"]
)
def test_vlm_tp2_matches_one_process(tmp_path: Any, family: str, sequence_parallel: bool) -> None:
    from transformers import AutoModelForImageTextToText

    assets = _assets(tmp_path, family)
    single = vlm_tp_steps(assets["model"], str(assets["train"]), "d1", sequence_parallel)
    assert single["losses"][-1] < single["losses"][0], single["losses"]
    sharded = get_rank_pool(2).run(
        vlm_tp_steps, assets["model"], str(assets["train"]), "t2", sequence_parallel, timeout_s=600
    )[0]
    initial = AutoModelForImageTextToText.from_pretrained(assets["model"]).state_dict()
    check_vlm_parity(single, sharded, initial)


def test_vlm_ulysses_cp2_matches_one_process(tmp_path: Any) -> None:
    from transformers import AutoModelForImageTextToText

    assets = _assets(tmp_path, "qwen3_vl")
    single = vlm_tp_steps(assets["model"], str(assets["train"]), "d1", True)
    sharded = get_rank_pool(2).run(vlm_tp_steps, assets["model"], str(assets["train"]), "c2", True, timeout_s=600)[0]
    initial = AutoModelForImageTextToText.from_pretrained(assets["model"]).state_dict()
    check_vlm_parity(single, sharded, initial)


def test_vlm_layout_refusals() -> None:
    from shardforge.algorithms.testing.vlm import build_vlm_tokenizer, tiny_qwen2_5_vl_config
    from shardforge.engine.checks import check_engine
    from shardforge.engine.config import EngineConfig
    from shardforge.mesh import ParallelDims

    config = tiny_qwen2_5_vl_config(build_vlm_tokenizer(), vocab_size=112)
    fine = (ParallelDims(dp_shard=2), ParallelDims(tp=2, dp_shard=1), ParallelDims(tp=2, dp_shard=2))
    for dims in (*fine, ParallelDims(cp=2, dp_shard=1), ParallelDims(cp=2, dp_shard=2)):
        check_engine(dims, config, EngineConfig())
    for dims in (ParallelDims(pp=2, dp_shard=1), ParallelDims(cp=2, tp=2, dp_shard=1)):
        with pytest.raises(ValueError, match=r"either tensor parallelism or Ulysses context parallelism composed"):
            check_engine(dims, config, EngineConfig())
    odd_vocab = tiny_qwen2_5_vl_config(build_vlm_tokenizer())  # 105 tokens
    with pytest.raises(ValueError, match=r"tp=2 must divide vocab_size=105"):
        check_engine(ParallelDims(tp=2, dp_shard=1), odd_vocab, EngineConfig())
    check_engine(ParallelDims(dp_shard=2), config, EngineConfig(head="value"))  # PPO's critic on a VLM
    for dims in (ParallelDims(tp=2, dp_shard=1), ParallelDims(cp=2, dp_shard=1)):
        with pytest.raises(ValueError, match=r"value head on a vision-language model .* supports data-parallel"):
            check_engine(dims, config, EngineConfig(head="value"))
    with pytest.raises(ValueError, match=r"'reward'.*\['lm', 'value'\]"):
        check_engine(ParallelDims(dp_shard=2), config, EngineConfig(head="reward"))
