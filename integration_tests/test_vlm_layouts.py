"""A vision-language model (tiny Qwen2.5-VL / Qwen3-VL) under HSDP (r2d2), FSDP x TP (d2t2) and FSDP x Ulysses
CP (d2c2), world 4, vs one process: same losses and same trained weights after a few SFT steps on image chat
rows, with one rank's micro-batch holding only a text-only row (it runs the dummy image, so the vision
tower's collectives still match)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shardforge.mesh.testing import get_rank_pool

STEPS = 3


@pytest.fixture(autouse=True)
def _single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from shardforge.algorithms.testing.vlm import tiny_vlm_assets

    return tiny_vlm_assets(tmp_path_factory.mktemp("vlm_hsdp"), seed=3, num_train=7, num_eval=1)


def _steps(model_dir: str, train: str, layout: str) -> dict[str, Any]:
    from transformers import AutoImageProcessor, AutoTokenizer

    from shardforge.algorithms.data.vlm import load_vlm_examples, pack_vlm_examples, tokenize_vlm_row
    from shardforge.engine import EngineConfig, OptimizerConfig, TrainEngine

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    processor = AutoImageProcessor.from_pretrained(model_dir)
    examples = load_vlm_examples(train, tokenizer, processor, image_token="<|image_pad|>")
    text_row = {"messages": [{"role": "user", "content": "say red"}, {"role": "assistant", "content": "red"}]}
    examples.append(tokenize_vlm_row(text_row, tokenizer, processor, image_token="<|image_pad|>"))  # index 7
    engine = TrainEngine(model_dir, layout, EngineConfig(optimizer=OptimizerConfig(lr=3e-3)))
    # 8 rows over 4 data-parallel ranks; the last rank's share is the text-only row alone (dummy image).
    mine = [[0, 1], [2, 3], [4, 5, 6], [7]][engine.dp_rank] if engine.dp_size == 4 else list(range(8))
    batch = pack_vlm_examples(examples, mine)
    losses = [engine.train_batch(batch)["loss"] for _ in range(STEPS)]
    return {"losses": losses, "weights": engine.full_state_dict(), "dp": engine.dp_size}


def test_hsdp_matches_one_process(vlm: dict[str, Any]) -> None:
    single = _steps(vlm["model"], str(vlm["train"]), "d1")
    assert single["losses"][-1] < 0.95 * single["losses"][0], single["losses"]  # the steps do train
    hsdp = get_rank_pool(4).run(_steps, vlm["model"], str(vlm["train"]), "r2d2", timeout_s=600)[0]
    assert hsdp["dp"] == 4
    # fp32; HSDP reduce-scatters within a replica and all-reduces across replicas, in another order than
    # one process sums: rounding only.
    torch.testing.assert_close(torch.tensor(hsdp["losses"]), torch.tensor(single["losses"]), rtol=1e-5, atol=0)
    assert hsdp["weights"].keys() == single["weights"].keys()
    for key, value in hsdp["weights"].items():
        torch.testing.assert_close(value, single["weights"][key], rtol=0, atol=2e-5, msg=key)


@pytest.mark.heavy  # heavy (world 4; ~40 s, more under load): CI keeps t2 for both families (test_alg_vlm_tp.py)
def test_fsdp_x_tp_matches_one_process(tmp_path: Any) -> None:
    """FSDP 2 x TP 2 with sequence parallelism (Qwen2.5-VL, world 4) vs one process: log-probs on image rows
    and a text-only row, losses and trained weights after SFT steps with an entropy term; one dp rank
    trains on the text-only row alone (dummy image, padded to the token multiple)."""
    from transformers import AutoModelForImageTextToText

    from shardforge.algorithms.testing.vlm import check_vlm_parity, tiny_vlm_assets, vlm_tp_steps

    assets = tiny_vlm_assets(tmp_path, seed=1, num_train=4, num_eval=1, vocab_size=112)
    single = vlm_tp_steps(assets["model"], str(assets["train"]), "d1", True)
    assert single["losses"][-1] < single["losses"][0], single["losses"]
    sharded = get_rank_pool(4).run(vlm_tp_steps, assets["model"], str(assets["train"]), "d2t2", True, timeout_s=600)
    initial = AutoModelForImageTextToText.from_pretrained(assets["model"]).state_dict()
    check_vlm_parity(single, sharded[0], initial)


@pytest.mark.heavy  # heavy (world 4; ~60 s, more under load): CI keeps c2 (test_alg_vlm_tp.py) and HSDP r2d2
def test_fsdp_x_ulysses_cp_matches_one_process(tmp_path: Any) -> None:
    """FSDP 2 x Ulysses CP 2 (Qwen3-VL with DeepStack, world 4) vs one process: log-probs on image rows and a
    text-only row, losses and trained weights after SFT steps with an entropy term; one dp rank's CP group
    trains on the text-only row alone (dummy image), so both CP groups cut sequences of other lengths."""
    from transformers import AutoModelForImageTextToText

    from shardforge.algorithms.testing.vlm import check_vlm_parity, tiny_vlm_assets, vlm_tp_steps

    assets = tiny_vlm_assets(tmp_path, seed=1, num_train=4, num_eval=1, family="qwen3_vl")
    single = vlm_tp_steps(assets["model"], str(assets["train"]), "d1", True)
    assert single["losses"][-1] < single["losses"][0], single["losses"]
    sharded = get_rank_pool(4).run(vlm_tp_steps, assets["model"], str(assets["train"]), "d2c2", True, timeout_s=600)
    initial = AutoModelForImageTextToText.from_pretrained(assets["model"]).state_dict()
    check_vlm_parity(single, sharded[0], initial)
    assert all(r["losses"] == sharded[0]["losses"] for r in sharded), "every rank reports the global loss"
