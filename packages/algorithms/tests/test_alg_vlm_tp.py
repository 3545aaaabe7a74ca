"""Tensor parallelism for vision-language models (`engine/vision_tp.py`): t2 (world 2) vs one process on
tiny Qwen3-VL (sequence parallel: the language model's input and DeepStack's inputs are cut per rank
after the image features are scattered in) and Qwen2.5-VL (without SP): the same log-probs on image rows
and on a text-only row (dummy image + padding to the token multiple), the same losses and the same
trained weights (vision tower included, replicated over the TP ranks) after SFT steps whose loss also
uses the entropy (vocab-parallel under TP). Refusals: CP/PP/EP, and a vocabulary tp does not divide."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shardforge.mesh.testing import get_rank_pool

STEPS = 2


@pytest.fixture(autouse=True)
def _single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


def _assets(root: Any, family: str) -> dict[str, Any]:
    from shardforge.algorithms.testing_vlm import tiny_vlm_assets

    # vocab 112 (the tokenizer has 105 tokens): tp=2 splits the embedding and the LM head.
    return tiny_vlm_assets(root, seed=1, num_train=4, num_eval=1, family=family, vocab_size=112)


def entropy_sft_loss(logprobs: torch.Tensor, batch: Any, entropy: torch.Tensor) -> torch.Tensor:
    """SFT loss minus 0.05 x the entropy of the target positions (the entropy's gradient flows too)."""
    return -((logprobs + 0.05 * entropy) * batch.loss_mask).sum()


entropy_sft_loss.wants_entropy = True  # type: ignore[attr-defined]


def tp_steps(model_dir: str, train: str, layout: str, sequence_parallel: bool) -> dict[str, Any]:
    """Log-probs of the image rows and of a text-only row, then `STEPS` SFT steps; rank split for dp 2:
    rank 0 the image rows, rank 1 the text-only row alone (its micro-batch runs the dummy image)."""
    from transformers import AutoImageProcessor, AutoTokenizer

    from shardforge.algorithms import EngineConfig, OptimizerConfig, TrainEngine
    from shardforge.algorithms.data.vlm import load_vlm_examples, pack_vlm_examples, tokenize_vlm_row

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    processor = AutoImageProcessor.from_pretrained(model_dir)
    examples = load_vlm_examples(train, tokenizer, processor, image_token="<|image_pad|>")
    text_row = {"messages": [{"role": "user", "content": "say red"}, {"role": "assistant", "content": "red"}]}
    examples.append(tokenize_vlm_row(text_row, tokenizer, processor, image_token="<|image_pad|>"))  # index 4
    config = EngineConfig(optimizer=OptimizerConfig(lr=3e-3), sequence_parallel=sequence_parallel)
    engine = TrainEngine(model_dir, layout, config)
    images = engine.forward(pack_vlm_examples(examples, [0, 1, 2, 3]))
    text = engine.forward(pack_vlm_examples(examples, [4]))
    mine = [[0, 1, 2, 3], [4]][engine.dp_rank] if engine.dp_size == 2 else [0, 1, 2, 3, 4]
    batch = pack_vlm_examples(examples, mine)
    losses = [engine.train_batch(batch, loss_fn=entropy_sft_loss)["loss"] for _ in range(STEPS)]
    return {"images": images, "text": text, "losses": losses, "weights": engine.full_state_dict()}


def check_parity(single: dict[str, Any], sharded: dict[str, Any], initial: dict[str, torch.Tensor]) -> None:
    """fp32; TP sums partial matmuls and the vocab-parallel softmax in another order: rounding only."""
    torch.testing.assert_close(sharded["images"], single["images"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sharded["text"], single["text"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.tensor(sharded["losses"]), torch.tensor(single["losses"]), rtol=1e-5, atol=0)
    assert sharded["weights"].keys() == single["weights"].keys()
    for key, value in sharded["weights"].items():
        torch.testing.assert_close(value, single["weights"][key], rtol=0, atol=2e-5, msg=key)
    moved = [k for k in initial if k.startswith("model.visual.") and not torch.equal(single["weights"][k], initial[k])]
    assert moved, "the vision tower trains"


@pytest.mark.parametrize(
    ("family", "sequence_parallel"), [("qwen2_5_vl", False), ("qwen3_vl", True)], ids=["qwen2_5_vl", "qwen3_vl-sp"]
)
def test_vlm_tp2_matches_one_process(tmp_path: Any, family: str, sequence_parallel: bool) -> None:
    from transformers import AutoModelForImageTextToText

    assets = _assets(tmp_path, family)
    single = tp_steps(assets["model"], str(assets["train"]), "d1", sequence_parallel)
    assert single["losses"][-1] < single["losses"][0], single["losses"]
    sharded = get_rank_pool(2).run(
        tp_steps, assets["model"], str(assets["train"]), "t2", sequence_parallel, timeout_s=600
    )[0]
    initial = AutoModelForImageTextToText.from_pretrained(assets["model"]).state_dict()
    check_parity(single, sharded, initial)


def test_vlm_layout_refusals() -> None:
    from shardforge.algorithms.engine.checks import check_engine
    from shardforge.algorithms.engine.config import EngineConfig
    from shardforge.algorithms.testing_vlm import build_vlm_tokenizer, tiny_qwen2_5_vl_config
    from shardforge.mesh import ParallelDims

    config = tiny_qwen2_5_vl_config(build_vlm_tokenizer(), vocab_size=112)
    for dims in (ParallelDims(dp_shard=2), ParallelDims(tp=2, dp_shard=1), ParallelDims(tp=2, dp_shard=2)):
        check_engine(dims, config, EngineConfig())
    for dims in (ParallelDims(cp=2, dp_shard=1), ParallelDims(pp=2, dp_shard=1)):
        with pytest.raises(ValueError, match=r"tensor parallelism composed with them \(e\.g\. d2t2, t2\), not"):
            check_engine(dims, config, EngineConfig())
    odd_vocab = tiny_qwen2_5_vl_config(build_vlm_tokenizer())  # 105 tokens
    with pytest.raises(ValueError, match=r"tp=2 must divide vocab_size=105"):
        check_engine(ParallelDims(tp=2, dp_shard=1), odd_vocab, EngineConfig())
    with pytest.raises(ValueError, match="head='lm' only"):
        check_engine(ParallelDims(dp_shard=2), config, EngineConfig(head="value"))
