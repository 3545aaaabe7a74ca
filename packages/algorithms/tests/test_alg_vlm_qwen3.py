"""Qwen3-VL (tiny, built locally) through the same VLM path as Qwen2.5-VL: the packed forward with
per-sequence mRoPE equals each sample run alone through plain transformers (Qwen3-VL adds interleaved
mRoPE, learned vision position embeddings and DeepStack features injected into the first text layer;
the images visibly change the log-probs), and FSDP 2 training equals world 1. The HF export's greedy
tokens are checked for both families in test_alg_vlm_sft_cli.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shardforge.algorithms.testing.vlm import vlm_sft_steps
from shardforge.mesh.testing import get_rank_pool


@pytest.fixture(autouse=True)
def _single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Larger initial weights (outputs depend visibly on positions and images), as the Qwen2.5-VL parity tests."""
    from shardforge.algorithms.testing.vlm import tiny_vlm_assets

    return tiny_vlm_assets(
        tmp_path_factory.mktemp("qwen3_vl"), seed=2, num_train=8, num_eval=3, initializer_range=0.2, family="qwen3_vl"
    )


def test_packed_forward_equals_each_sample_alone(vlm: dict[str, Any]) -> None:
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    from shardforge.algorithms.data.vlm import load_vlm_examples, pack_vlm_examples
    from shardforge.engine import EngineConfig, TrainEngine

    processor = AutoImageProcessor.from_pretrained(vlm["model"])
    tokenizer = AutoTokenizer.from_pretrained(vlm["model"])
    examples = load_vlm_examples(vlm["train"], tokenizer, processor, image_token="<|image_pad|>")[:4]
    assert {e.image_grid_thw.shape[0] for e in examples} == {1, 2}  # one row with two images
    engine = TrainEngine(vlm["model"], "d1", EngineConfig())
    packed = engine.forward(pack_vlm_examples(examples, list(range(4))))
    model = AutoModelForImageTextToText.from_pretrained(vlm["model"]).eval()
    assert type(model).__name__ == "Qwen3VLForConditionalGeneration"
    image_id = model.config.image_token_id
    offset = 0

    def alone(ids: torch.Tensor, pixels: torch.Tensor, grids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():  # plain transformers: unpacked, its own 3-D rope index
            logits = model(
                input_ids=ids, pixel_values=pixels, image_grid_thw=grids, mm_token_type_ids=(ids == image_id).int()
            ).logits[0]
        return torch.log_softmax(logits.float(), -1)[:-1].gather(-1, ids[0, 1:, None])[:, 0]

    for e in examples:
        ids = torch.tensor([e.input_ids])
        reference = alone(ids, e.pixel_values, e.image_grid_thw)
        mine = packed[offset + 1 : offset + len(e.input_ids)]
        # fp32, the same math (the CPU packed attention runs SDPA per sequence): rounding at most.
        torch.testing.assert_close(mine, reference, rtol=1e-4, atol=1e-5)
        # The check can see the image: other pixels give other log-probs after the image tokens.
        assert (alone(ids, torch.zeros_like(e.pixel_values), e.image_grid_thw) - reference).abs().max() > 1e-2
        offset += len(e.input_ids)


def test_qwen3_vl_sft_world1_matches_fsdp2(vlm: dict[str, Any]) -> None:
    single = vlm_sft_steps(vlm["model"], str(vlm["train"]), "d1", ())
    assert single["losses"][-1] < 0.9 * single["losses"][0], single["losses"]
    sharded = get_rank_pool(2).run(vlm_sft_steps, vlm["model"], str(vlm["train"]), "d2", (), timeout_s=600)[0]
    # fp32; FSDP reduce-scatters gradients in another order than one process sums them: rounding only.
    torch.testing.assert_close(torch.tensor(sharded["losses"]), torch.tensor(single["losses"]), rtol=1e-5, atol=0)
    # Every weight, the key bias too (its gradient is exactly 0 in exact arithmetic): vlm_sft_steps's AdamW eps
    # keeps Adam from scaling rounding noise in near-zero gradients up to ~lr.
    for key, value in sharded["weights"].items():
        torch.testing.assert_close(value, single["weights"][key], rtol=0, atol=2e-5, msg=key)
    assert any(k.startswith("model.visual.deepstack") for k in single["weights"]), "DeepStack mergers are trained"
