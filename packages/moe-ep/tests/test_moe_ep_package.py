"""Packaging checks and the single-process pieces: public surface, validation errors, grouped matmul."""

import importlib.metadata

import pytest
import torch

import shardforge.moe_ep as pkg
from shardforge.mesh import ParallelDims


def test_version_matches_distribution() -> None:
    assert pkg.__version__ == importlib.metadata.version("shardforge-moe-ep")


def test_public_surface_is_all() -> None:
    public = sorted(n for n in dir(pkg) if not n.startswith("_"))
    # Submodules are importable attributes too; everything else public must be in __all__.
    modules = {"apply", "comm", "experts", "families", "grouped", "replay", "router", "strided"}
    assert sorted(set(public) - modules) == sorted(pkg.__all__)
    assert "apply_expert_parallel" in pkg.__all__ and "RouterRecorder" in pkg.__all__


def test_supported_families() -> None:
    assert pkg.supported_moe_families() == ["mixtral", "olmoe", "qwen2_moe", "qwen3_moe"]


def _config(**kwargs: int) -> object:
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(num_experts=kwargs.get("experts", 8), moe_intermediate_size=kwargs.get("inter", 12))


def test_validation_errors_list_valid_values() -> None:
    with pytest.raises(ValueError, match=r"ep=3 must divide dp_shard\*cp\*tp=4.*valid ep: \[1, 2, 4\]"):
        pkg.validate_expert_parallel(ParallelDims(dp_shard=4, ep=3), _config())
    with pytest.raises(ValueError, match=r"must divide num_experts=6; valid ep: \[1, 2, 3, 6\]"):
        pkg.validate_expert_parallel(ParallelDims(dp_shard=4, ep=4), _config(experts=6))
    with pytest.raises(ValueError, match=r"moe_intermediate_size=12 over tp=8; valid tp: \[1, 2, 3, 4, 6, 12\]"):
        pkg.validate_expert_parallel(ParallelDims(dp_shard=1, tp=8), _config())
    with pytest.raises(ValueError, match="etp=2 must be 1 or equal to tp=4"):
        pkg.validate_expert_parallel(ParallelDims(dp_shard=1, tp=4, etp=2), _config())
    pkg.validate_expert_parallel(ParallelDims(dp_shard=2, tp=2, ep=4), _config())  # borrows tp ranks: fine
    # EP + expert TP (etp = tp): ep splits only dp_shard x cp, the tp ranks split each expert.
    with pytest.raises(ValueError, match=r"ep=4 must divide dp_shard\*cp=2.*valid ep: \[1, 2\]"):
        pkg.validate_expert_parallel(ParallelDims(dp_shard=2, tp=2, ep=4, etp=2), _config())
    pkg.validate_expert_parallel(ParallelDims(dp_shard=2, tp=2, ep=2, etp=2), _config())


def test_unknown_family_error_lists_supported() -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    model = AutoModelForCausalLM.from_config(
        LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=32)
    )
    with pytest.raises(ValueError, match=r"supported MoE families: \['mixtral', 'olmoe', 'qwen2_moe', 'qwen3_moe'\]"):
        pkg.apply_expert_parallel(model, None)


@pytest.mark.parametrize(
    ("dtype", "out_dim", "kernel"),
    [(torch.float32, 8, True), (torch.float32, 6, False), (torch.float64, 8, False)],
    ids=["fp32-grouped_mm", "fp32-unaligned-loop", "fp64-loop"],
)
def test_grouped_linear_matches_per_expert_matmuls(dtype: torch.dtype, out_dim: int, kernel: bool) -> None:
    # Aligned float32 takes the grouped_mm kernel on CPU; unaligned rows (6 x 4 bytes) and
    # float64 take the per-expert loop. All must equal a plain loop, with empty groups in the
    # middle and at the end, including gradients.
    gen = torch.Generator().manual_seed(0)
    counts = torch.tensor([3, 0, 5, 2, 0])
    x = torch.randn(int(counts.sum()), 8, generator=gen, dtype=dtype, requires_grad=True)
    w = torch.randn(5, out_dim, 8, generator=gen, dtype=dtype, requires_grad=True)
    out = pkg.grouped_linear(x, w, counts)
    out.sum().backward()  # an expanded (stride-0) gradient: the grouped kernel needs it contiguous
    gx, gw = x.grad, w.grad
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = torch.cat([c @ w2[e].T for e, c in enumerate(torch.split(x2, counts.tolist()))])
    ref.sum().backward()
    assert pkg.grouped_mm_available(x, w) == kernel
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(gx, x2.grad)
    torch.testing.assert_close(gw, w2.grad)
    assert torch.count_nonzero(gw[1]) == 0 and torch.count_nonzero(gw[4]) == 0
