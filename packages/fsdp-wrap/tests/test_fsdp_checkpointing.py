"""Activation checkpointing: same numbers, same names, and the layers really are recomputed.

Recomputation replays the same float32 CPU kernels on the same inputs, so loss and gradients
with checkpointing are expected to be bit-identical to the run without it (compared exactly).
Whether a layer was checkpointed is observed directly: its attention module runs forward
twice (once in forward, once when backward recomputes it).
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardforge.fsdp_wrap import ActivationCheckpointConfig, apply_activation_checkpointing
from shardforge.mesh.testing import get_rank_pool

VOCAB = 64
NUM_LAYERS = 3  # odd, so selective(every=2) -> layers 0 and 2, distinguishable from full
EXACT = {"rtol": 0, "atol": 0}
# For the FSDP run vs the unsharded reference: see GRAD_TOL in test_fsdp_parity.py.
GRAD_TOL = {"rtol": 1e-5, "atol": 1e-6}


def tiny_config(arch: str = "qwen3") -> Any:
    from transformers import LlamaConfig, Qwen3Config

    cls = {"qwen3": Qwen3Config, "llama": LlamaConfig}[arch]
    return cls(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
    )


def build_model(arch: str = "qwen3", seed: int = 0) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(arch))


def _count_attention_calls(model: torch.nn.Module) -> list[int]:
    counts = [0] * len(model.model.layers)
    for index, layer in enumerate(model.model.layers):

        def hook(*_: Any, index: int = index) -> None:
            counts[index] += 1

        layer.self_attn.register_forward_hook(hook)
    return counts


def _step(model: torch.nn.Module, input_ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    out = model(input_ids=input_ids, labels=input_ids)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _inputs(batch: int = 2) -> torch.Tensor:
    torch.manual_seed(99)
    return torch.randint(0, VOCAB, (batch, 10))


# ---------------------------------------------------------------------------------------------- rank functions
def _fsdp_with_checkpointing(
    state: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], input_ids: torch.Tensor
) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from shardforge.fsdp_wrap import apply_fsdp, load_full_state_dict
    from shardforge.mesh import ParallelDims, build_mesh

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = build_mesh(ParallelDims(dp_shard=world)).get("fsdp")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config())
    marked = apply_activation_checkpointing(model, ActivationCheckpointConfig(mode="full"))  # before FSDP
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        apply_fsdp(model, mesh)
    load_full_state_dict(model, state if rank == 0 else None, device="cpu", buffers=buffers if rank == 0 else None)
    counts = _count_attention_calls(model)
    chunk = input_ids.chunk(world)[rank]
    out = model(input_ids=chunk, labels=chunk)
    out.loss.backward()
    return {
        "marked": marked,
        "counts": counts,
        "loss": out.loss.detach(),
        "grads": {n: p.grad.full_tensor() for n, p in model.named_parameters()},
        "keys": list(model.state_dict()),
    }


# ---------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize(
    ("config", "marked", "counts"),
    [
        (ActivationCheckpointConfig(), 0, [1, 1, 1]),
        (ActivationCheckpointConfig(mode="full"), 3, [2, 2, 2]),
        (ActivationCheckpointConfig(mode="selective", every=2), 2, [2, 1, 2]),
        (ActivationCheckpointConfig(mode="selective", every=1), 3, [2, 2, 2]),
        (ActivationCheckpointConfig(mode="selective", every=5), 1, [2, 1, 1]),
        (
            ActivationCheckpointConfig(mode="full", layer_classes=("Qwen3DecoderLayer", "LlamaDecoderLayer")),
            3,
            [2, 2, 2],
        ),
    ],
    ids=["none", "full", "selective2", "selective1", "selective5", "explicit-classes"],
)
def test_checkpointing_is_exact_and_recomputes_marked_layers(
    arch: str, config: ActivationCheckpointConfig, marked: int, counts: list[int]
) -> None:
    x = _inputs()
    reference = build_model(arch)
    ref_loss, ref_grads = _step(reference, x)

    model = build_model(arch)
    names = [n for n, _ in model.named_parameters()]
    keys = list(model.state_dict())
    assert apply_activation_checkpointing(model, config) == marked
    # The composable API hooks modules in place: no wrapper modules, no renamed parameters.
    assert [n for n, _ in model.named_parameters()] == names
    assert list(model.state_dict()) == keys
    model.load_state_dict(reference.state_dict())  # checkpoint-compatible both ways

    calls = _count_attention_calls(model)
    loss, grads = _step(model, x)
    assert calls == counts
    torch.testing.assert_close(loss, ref_loss, **EXACT)
    assert grads.keys() == ref_grads.keys()
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, **EXACT, msg=lambda m, n=name: f"{n}: {m}")


def test_checkpointing_under_fsdp_matches_unsharded() -> None:
    reference = build_model()
    state = copy.deepcopy(reference.state_dict())
    buffers = {n: b.clone() for n, b in reference.named_buffers()}
    x = _inputs(batch=4)
    ref_loss, ref_grads = _step(reference, x)
    results = get_rank_pool(2).run(_fsdp_with_checkpointing, state, buffers, x)
    torch.testing.assert_close(torch.stack([r["loss"] for r in results]).mean(), ref_loss, rtol=1e-6, atol=1e-6)
    for r in results:
        assert r["marked"] == NUM_LAYERS
        assert r["counts"] == [2] * NUM_LAYERS
        assert r["keys"] == list(state)  # FSDP + checkpointing keep the state-dict keys
        for name, grad in ref_grads.items():
            torch.testing.assert_close(r["grads"][name], grad, **GRAD_TOL, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize(
    ("config", "match"),
    [
        (ActivationCheckpointConfig(mode="sometimes"), "mode='sometimes'.*'none', 'full', 'selective'"),  # type: ignore[arg-type]
        (ActivationCheckpointConfig(mode="selective", every=0), "every >= 1, got 0"),
        (ActivationCheckpointConfig(mode="selective", every=-2), "every >= 1, got -2"),
        (ActivationCheckpointConfig(mode="full", layer_classes=("NoSuchLayer",)), "NoSuchLayer.*Qwen3DecoderLayer"),
        (ActivationCheckpointConfig(mode="full", layer_classes=()), "none of the layer classes"),
    ],
    ids=["bad-mode", "every0", "every-negative", "unknown-class", "empty-classes"],
)
def test_bad_config_raises(config: ActivationCheckpointConfig, match: str) -> None:
    model = build_model()
    with pytest.raises(ValueError, match=match):
        apply_activation_checkpointing(model, config)
    assert not any(m._forward_pre_hooks for m in model.modules())  # nothing was half-applied


def test_selective_every_is_ignored_for_full_mode() -> None:
    # `every` only matters for mode="selective"; a leftover every=0 must not break mode="full".
    assert apply_activation_checkpointing(build_model(), ActivationCheckpointConfig(mode="full", every=0)) == NUM_LAYERS


def test_model_without_no_split_modules_raises_helpful_error() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
    with pytest.raises(
        ValueError, match=r"Sequential has no `_no_split_modules`.*ActivationCheckpointConfig\(layer_classes="
    ):
        apply_activation_checkpointing(model, ActivationCheckpointConfig(mode="full"))
    # Naming the classes explicitly works for any model.
    assert (
        apply_activation_checkpointing(model, ActivationCheckpointConfig(mode="full", layer_classes=("Linear",))) == 2
    )

    hf = build_model()
    hf._no_split_modules = None
    with pytest.raises(ValueError, match="no `_no_split_modules`"):
        apply_activation_checkpointing(hf, ActivationCheckpointConfig(mode="full"))
