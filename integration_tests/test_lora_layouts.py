"""LoRA through the real `TrainEngine`: world 1 vs FSDP 2 vs FSDP 2 x TP 2 (world 4).

Every layout trains the same adapters (q/k/v/o and the MLP projections, so colwise and rowwise TP
parents are both covered) for STEPS steps from the same base model and adapter init, and must give the
same losses and adapters. The FSDP 2 run also checks that
- its DCP checkpoint holds only adapter params and their optimizer state, and that a fresh engine
  resumed from it (base re-read from the model directory) reproduces the last step exactly;
- `export_lora` loads with `peft.PeftModel.from_pretrained` and gives the engine's log-probs;
- `export_hf` (merged) equals PEFT's ``merge_and_unload()`` of that adapter.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from shardforge.mesh.testing import get_rank_pool

STEPS = 3
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from shardforge.algorithms.testing import tiny_assets

    root = tmp_path_factory.mktemp("lora_engine")
    tiny_assets(root, seed=4, data=False)
    return str(root / "model")


def _sequences(step: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(100 + step)
    lengths = torch.randint(5, 14, (6,), generator=g).tolist()
    return [torch.randint(3, 20, (n,), generator=g).tolist() for n in lengths]


def _engine(model_dir: str, layout: str) -> Any:
    from shardforge.algorithms.config_io import apply_overrides, build_config
    from shardforge.engine import TrainEngine
    from shardforge.engine.config import EngineConfig

    # Built the way the CLI builds it (engine.lora.* overrides), to cover the config path too.
    overrides = ["lora.r=4", "lora.alpha=8", f"lora.target_modules=[{','.join(TARGETS)}]", "optimizer.lr=2e-2"]
    config = build_config(EngineConfig, apply_overrides({"max_tokens_per_microbatch": 40}, overrides))
    return TrainEngine(model_dir, layout, config)


def _local(engine: Any, step: int) -> Any:
    from shardforge.engine.batching import pack_sequences

    return pack_sequences(_sequences(step)[engine.dp_rank :: engine.dp_size])


def _train(model_dir: str, layout: str, out: str | None) -> dict[str, Any]:
    import torch.distributed as dist

    from shardforge.checkpoint_dcp import Checkpointer
    from shardforge.lora import lora_state_dict, merged_state_dict

    engine = _engine(model_dir, layout)
    checkpointer = Checkpointer(Path(out) / "ckpt") if out else None
    losses = []
    for step in range(STEPS):
        if checkpointer is not None and step == STEPS - 1:
            engine.save(checkpointer)
        losses.append(engine.train_batch(_local(engine, step))["loss"])
    result: dict[str, Any] = {
        "losses": losses,
        "adapters": lora_state_dict(engine.model),
        "merged": merged_state_dict(engine.model),  # FSDP x TP: each rank adds its (strided) shard of B @ A
        "trainable": sorted(n for n, p in engine.model.named_parameters() if p.requires_grad),
        "optimized": sum(p.numel() for g in engine.optimizer.param_groups for p in g["params"]),
    }
    if out is None:
        return result
    from shardforge.engine.batching import pack_sequences

    result["logprobs"] = engine.forward(pack_sequences(_sequences(99)))
    engine.export_lora(Path(out) / "adapter")
    engine.export_hf(Path(out) / "hf")
    resumed = _engine(model_dir, layout)
    resumed.load(checkpointer)  # type: ignore[arg-type]
    result["resumed_step"] = resumed.step
    result["resumed_loss"] = resumed.train_batch(_local(resumed, STEPS - 1))["loss"]
    result["resumed_adapters"] = lora_state_dict(resumed.model)
    return result if dist.get_rank() == 0 else {}


@pytest.fixture(scope="module")
def world1(model_dir: str) -> dict[str, Any]:
    return _train(model_dir, "d1", None)


@pytest.fixture(scope="module")
def fsdp2(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = str(tmp_path_factory.mktemp("lora_fsdp2"))
    return {"out": out, **get_rank_pool(2).run(_train, model_dir, "d2", out)[0]}


def _assert_same_training(result: dict[str, Any], reference: dict[str, Any]) -> None:
    # Sharded runs reduce in another order (reduce-scatter; TP partial sums): fp32 rounding that 3 Adam
    # steps amplify (an entry whose gradient nearly cancels has a large relative error, and Adam normalises
    # it to an lr-sized step). Observed: losses 1.4e-7 (d2) / 2.8e-7 (d2t2); adapters 3.2e-6 (d2) /
    # 1.7e-5 (d2t2). Bound: 1e-4, 0.5% of one step (lr = 2e-2); a wrong reduction or shard changes the
    # update direction and moves adapters by whole steps.
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(reference["losses"]), rtol=1e-5, atol=1e-6)
    assert result["adapters"].keys() == reference["adapters"].keys()
    for name, value in reference["adapters"].items():
        torch.testing.assert_close(result["adapters"][name], value, rtol=0, atol=1e-4, msg=name)
    assert result["merged"].keys() == reference["merged"].keys()
    for name, value in reference["merged"].items():
        torch.testing.assert_close(result["merged"][name], value, rtol=0, atol=1e-4, msg=name)


def test_world1_trains_only_adapters(world1: dict[str, Any]) -> None:
    assert world1["trainable"] and all(".lora_A." in n or ".lora_B." in n for n in world1["trainable"])
    assert len(world1["trainable"]) == 2 * 2 * len(TARGETS)  # 2 layers x (A, B) per target
    assert world1["optimized"] == sum(v.numel() for v in world1["adapters"].values())
    assert world1["losses"][-1] < world1["losses"][0]


def test_fsdp2_matches_world1(fsdp2: dict[str, Any], world1: dict[str, Any]) -> None:
    _assert_same_training(fsdp2, world1)


def test_fsdp2_tp2_matches_world1(model_dir: str, world1: dict[str, Any]) -> None:
    _assert_same_training(get_rank_pool(4).run(_train, model_dir, "d2t2", None)[0], world1)


def test_checkpoint_holds_only_adapters_and_resume_is_exact(fsdp2: dict[str, Any]) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    [step_dir] = [p for p in (Path(fsdp2["out"]) / "ckpt").iterdir() if p.is_dir()]
    keys = list(FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata)
    model_keys = [k for k in keys if k.startswith("train.model.")]
    optim_keys = [k for k in keys if k.startswith("train.optimizer.state.")]
    assert len(model_keys) == len(fsdp2["adapters"])
    assert all(".lora_A." in k or ".lora_B." in k for k in model_keys + optim_keys), model_keys + optim_keys
    assert len(optim_keys) == 3 * len(model_keys)  # AdamW: step, exp_avg, exp_avg_sq per adapter
    assert fsdp2["resumed_step"] == STEPS - 1
    assert fsdp2["resumed_loss"] == fsdp2["losses"][-1]
    for name, value in fsdp2["adapters"].items():
        torch.testing.assert_close(fsdp2["resumed_adapters"][name], value, rtol=0, atol=0, msg=name)


def test_exports_load_in_peft_and_transformers(fsdp2: dict[str, Any], model_dir: str) -> None:
    import torch.nn.functional as F
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    peft_model = PeftModel.from_pretrained(base, str(Path(fsdp2["out"]) / "adapter")).eval()
    expected = []
    with torch.no_grad():
        for seq in _sequences(99):
            ids = torch.tensor(seq)[None]
            logp = F.log_softmax(peft_model(input_ids=ids).logits[0, :-1].float(), -1)
            expected += [0.0, *logp.gather(-1, ids[0, 1:, None])[:, 0].tolist()]
    # Same weights; the engine runs packed (varlen) attention, PEFT padded-free SDPA per sequence.
    torch.testing.assert_close(fsdp2["logprobs"], torch.tensor(expected), rtol=1e-5, atol=1e-5)
    merged = peft_model.merge_and_unload().state_dict()
    exported = load_file(str(Path(fsdp2["out"]) / "hf" / "model.safetensors"))
    assert exported.keys() == {k for k in merged if k != "lm_head.weight" or "lm_head.weight" in exported}
    for name, value in exported.items():
        torch.testing.assert_close(value, merged[name], rtol=0, atol=1e-6, msg=name)
