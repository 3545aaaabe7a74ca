"""Vision-language models (tiny Qwen2.5-VL): assets load with the HF auto classes, a packed forward with
per-sequence mRoPE equals each sample run alone through plain transformers, SFT on image chat rows lowers
the loss, and FSDP 2 matches world 1 (loss and trained weights); TP and the refusals: test_alg_vlm_tp.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shardforge.algorithms.testing.vlm import vlm_sft_steps
from shardforge.mesh.testing import get_rank_pool


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from shardforge.algorithms.testing.vlm import tiny_vlm_assets

    return tiny_vlm_assets(tmp_path_factory.mktemp("vlm"), seed=0, num_train=6, num_eval=2)


@pytest.fixture(scope="module")
def sharp_vlm(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Larger initial weights: outputs depend visibly on positions and images (see tiny_qwen2_5_vl_config)."""
    from shardforge.algorithms.testing.vlm import tiny_vlm_assets

    return tiny_vlm_assets(tmp_path_factory.mktemp("vlm_sharp"), seed=1, num_train=4, num_eval=1, initializer_range=0.2)


def _examples(assets: dict[str, Any], split: str = "train") -> list[Any]:
    from transformers import AutoImageProcessor, AutoTokenizer

    from shardforge.algorithms.data.vlm import load_vlm_examples

    tokenizer = AutoTokenizer.from_pretrained(assets["model"])
    image_processor = AutoImageProcessor.from_pretrained(assets["model"])
    return load_vlm_examples(assets[split], tokenizer, image_processor, image_token="<|image_pad|>")


def test_assets_load_with_hf_auto_classes(vlm: dict[str, Any]) -> None:
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    model = AutoModelForImageTextToText.from_pretrained(vlm["model"])
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert (
        AutoTokenizer.from_pretrained(vlm["model"]).convert_tokens_to_ids("<|image_pad|>")
        == model.config.image_token_id
    )
    assert AutoImageProcessor.from_pretrained(vlm["model"]).merge_size == 2
    examples = _examples(vlm)
    # Rows with two images carry two grids; every image token has a vision-tower output to fill it.
    assert {e.image_grid_thw.shape[0] for e in examples} == {1, 2}
    for e in examples:
        image_tokens = sum(t == model.config.image_token_id for t in e.input_ids)
        assert image_tokens == int(e.image_grid_thw.prod(-1).sum()) // 4 == e.pixel_values.shape[0] // 4
        assert sum(e.loss_mask) > 0 and all(m == 0 for t, m in zip(e.input_ids, e.loss_mask) if t == 6)


def test_packed_forward_equals_each_sample_alone(sharp_vlm: dict[str, Any]) -> None:
    from transformers import AutoModelForImageTextToText

    from shardforge.algorithms.data.vlm import pack_vlm_examples
    from shardforge.engine import EngineConfig, TrainEngine

    examples = _examples(sharp_vlm)[:4]
    engine = TrainEngine(sharp_vlm["model"], "d1", EngineConfig())
    packed = engine.forward(pack_vlm_examples(examples, list(range(4))))
    model = AutoModelForImageTextToText.from_pretrained(sharp_vlm["model"]).eval()
    image_id = model.config.image_token_id
    offset, spread = 0, []
    for e in examples:
        ids = torch.tensor([e.input_ids])
        with torch.no_grad():  # plain transformers: unpacked, its own 3-D rope index
            logits = model(
                input_ids=ids, pixel_values=e.pixel_values, image_grid_thw=e.image_grid_thw,
                mm_token_type_ids=(ids == image_id).int(),
            ).logits[0]  # fmt: skip
        alone = torch.log_softmax(logits.float(), -1)[:-1].gather(-1, ids[0, 1:, None])[:, 0]
        mine = packed[offset + 1 : offset + len(e.input_ids)]
        # fp32, same math in another attention kernel (packed SDPA vs masked SDPA): rounding only.
        torch.testing.assert_close(mine, alone, rtol=1e-4, atol=1e-5)
        offset += len(e.input_ids)
        spread.append(float(alone.max() - alone.min()))
    assert min(spread) > 0.5, f"the model is too flat for this check to see wrong positions: {spread}"


@pytest.mark.parametrize("freeze", [(), ("model.visual",)], ids=["all", "frozen_vision"])
def test_vlm_sft_world1_matches_fsdp2(vlm: dict[str, Any], freeze: tuple[str, ...]) -> None:
    from transformers import AutoModelForImageTextToText

    single = vlm_sft_steps(vlm["model"], str(vlm["train"]), "d1", freeze)
    assert single["losses"][-1] < 0.9 * single["losses"][0], single["losses"]
    sharded = get_rank_pool(2).run(vlm_sft_steps, vlm["model"], str(vlm["train"]), "d2", freeze, timeout_s=600)[0]
    # fp32; FSDP reduce-scatters gradients in another order than one process sums them: rounding only.
    torch.testing.assert_close(torch.tensor(sharded["losses"]), torch.tensor(single["losses"]), rtol=1e-5, atol=0)
    initial = AutoModelForImageTextToText.from_pretrained(vlm["model"]).state_dict()
    assert sharded["weights"].keys() == single["weights"].keys()
    for key, value in sharded["weights"].items():
        torch.testing.assert_close(value, single["weights"][key], rtol=0, atol=2e-5, msg=key)
        if key.startswith("model.visual.") and freeze:
            assert torch.equal(value, initial[key]), f"frozen {key} changed"
    visual = [k for k in single["weights"] if k.startswith("model.visual.")]
    moved = [k for k in visual if not torch.equal(single["weights"][k], initial[k])]
    assert visual and bool(moved) != bool(freeze), "the vision tower trains unless frozen"


def _mixed_steps(model_dir: str, train: str, layout: str) -> list[float]:
    from transformers import AutoImageProcessor, AutoTokenizer

    from shardforge.algorithms.data.vlm import load_vlm_examples, pack_vlm_examples, tokenize_vlm_row
    from shardforge.engine import EngineConfig, OptimizerConfig, TrainEngine

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    processor = AutoImageProcessor.from_pretrained(model_dir)
    image_rows = load_vlm_examples(train, tokenizer, processor, image_token="<|image_pad|>")[:2]
    text_row = {"messages": [{"role": "user", "content": "say red"}, {"role": "assistant", "content": "red"}]}
    text = tokenize_vlm_row(text_row, tokenizer, processor, image_token="<|image_pad|>")
    examples = [*image_rows, text]
    engine = TrainEngine(model_dir, layout, EngineConfig(optimizer=OptimizerConfig(lr=3e-3)))
    # d2: rank 0 gets both image rows, rank 1 only the text row (its micro-batch runs the dummy image).
    mine = [[0, 1], [2]][engine.dp_rank] if engine.dp_size == 2 else [0, 1, 2]
    batch = pack_vlm_examples(examples, mine)
    return [engine.train_batch(batch)["loss"] for _ in range(3)]


def test_text_only_rank_joins_the_vision_collectives(vlm: dict[str, Any]) -> None:
    single = _mixed_steps(vlm["model"], str(vlm["train"]), "d1")
    sharded = get_rank_pool(2).run(_mixed_steps, vlm["model"], str(vlm["train"]), "d2", timeout_s=600)[0]
    # The dummy image adds nothing to the loss or the gradients: same steps as one process (fp32 rounding).
    torch.testing.assert_close(torch.tensor(sharded), torch.tensor(single), rtol=1e-5, atol=0)
