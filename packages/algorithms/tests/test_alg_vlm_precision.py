"""Mixed precision for vision-language models under FSDP 2: the vision blocks are their own FSDP units
that do not cast their inputs (the fp32 rotary cos/sin reach the vision attention as fp32), the decoder
layers do (bf16), and a bf16-compute run tracks the fp32 run's losses."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shardforge.mesh.testing import get_rank_pool


@pytest.fixture(autouse=True)
def _single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from shardforge.algorithms.testing.vlm import tiny_vlm_assets

    return tiny_vlm_assets(tmp_path_factory.mktemp("vlm_mp"), seed=0, num_train=4, num_eval=1)


def _steps(model_dir: str, train: str, compute_dtype: str | None) -> dict[str, Any]:
    from transformers import AutoImageProcessor, AutoTokenizer

    from shardforge.algorithms.data.vlm import load_vlm_examples, pack_vlm_examples
    from shardforge.engine import EngineConfig, OptimizerConfig, TrainEngine
    from shardforge.engine.vision import vision_tower

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    examples = load_vlm_examples(
        train, tokenizer, AutoImageProcessor.from_pretrained(model_dir), image_token="<|image_pad|>"
    )
    config = EngineConfig(optimizer=OptimizerConfig(lr=3e-3), compute_dtype=compute_dtype)
    engine = TrainEngine(model_dir, "d2", config)
    seen: dict[str, str] = {}

    def record(name: str) -> Any:
        def hook(module: Any, args: Any, kwargs: Any) -> None:
            hidden = args[0] if args else kwargs["hidden_states"]
            seen[f"{name}.hidden"] = str(hidden.dtype)
            seen[f"{name}.cos"] = str(kwargs["position_embeddings"][0].dtype)

        return hook

    block = vision_tower(engine.model).blocks[0]  # type: ignore[union-attr]
    layer = engine.model.model.language_model.layers[0]  # type: ignore[union-attr]
    # On the modules inside the FSDP units: they see the inputs after FSDP's (possible) cast.
    block.attn.register_forward_pre_hook(record("vision_attn"), with_kwargs=True)
    layer.self_attn.register_forward_pre_hook(record("text_attn"), with_kwargs=True)
    batch = pack_vlm_examples(examples, list(range(engine.dp_rank, len(examples), engine.dp_size)))
    losses = [engine.train_batch(batch)["loss"] for _ in range(3)]
    return {"losses": losses, "dtypes": seen}


def test_vision_blocks_keep_fp32_rotary_inputs_under_bf16_fsdp(vlm: dict[str, Any]) -> None:
    pool = get_rank_pool(2)
    mixed = pool.run(_steps, vlm["model"], str(vlm["train"]), "bf16", timeout_s=600)[0]
    full = pool.run(_steps, vlm["model"], str(vlm["train"]), None, timeout_s=600)[0]
    assert mixed["dtypes"] == {
        "vision_attn.hidden": "torch.bfloat16",  # cast by the patch embedding (bf16 weights), not by FSDP
        "vision_attn.cos": "torch.float32",  # not cast: the vision blocks keep their input dtype
        "text_attn.hidden": "torch.bfloat16",
        "text_attn.cos": "torch.bfloat16",  # decoder layers: inputs cast as for text models
    }, mixed["dtypes"]
    assert set(full["dtypes"].values()) == {"torch.float32"}
    # bf16 compute (8-bit mantissa) vs fp32 on the same weights and data: the losses agree to bf16 rounding.
    torch.testing.assert_close(torch.tensor(mixed["losses"]), torch.tensor(full["losses"]), rtol=2e-2, atol=0)
    assert mixed["losses"][-1] < mixed["losses"][0], mixed["losses"]
