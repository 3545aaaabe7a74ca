"""`serve.tp_lora` on 2 gloo ranks (tp=2 with sequence parallelism, the base built by the engine) against plain
LoRA models in one process: two tenants' adapters (ranks 4 and 8, every target: attention, MLP, LM head, B non-zero
so every A gets a gradient) batched in one packed forward.

Per adapter: a rank's own gradient is only a share of the 1-rank gradient (the test checks that some rank's differs,
for every adapter of each of the four kinds: column/row-parallel A and B), and the sum over the TP ranks equals the 1-rank gradient on
every rank (rel 1e-5: partial matmuls summed over the ranks, another float summation order). The log-probs equal
the 1-rank ones.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from shardforge.mesh.testing import get_rank_pool

TEXTS = [[1, 5, 6, 7, 8, 9], [1, 9, 10, 11, 12, 13, 14], [1, 4, 2, 3], [1, 6, 6, 6, 7, 8, 9, 2, 5], [1, 7, 7]]
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")
TENANTS = ((4, 1, slice(0, 3)), (8, 2, slice(3, 5)))  # (LoRA rank, seed, its datums)
COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "lm_head")


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from shardforge.rollout.testing.tiny import tiny_model

    return tiny_model(tmp_path_factory.mktemp("tp_lora"))["model"]


def _tenants(model_dir: str) -> list[torch.nn.Module]:
    """The two tenants' models (the same on every rank: seeded), their B's made non-zero."""
    from transformers import AutoModelForCausalLM

    from shardforge.lora import LoRAConfig, apply_lora, lora_modules

    base = AutoModelForCausalLM.from_pretrained(model_dir)
    models = []
    for rank, seed, _ in TENANTS:
        model = copy.deepcopy(base)
        apply_lora(model, LoRAConfig(r=rank, alpha=16.0, target_modules=TARGETS), seed=seed)
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for _, lora in lora_modules(model):
                lora.lora_B.weight.copy_(torch.randn(lora.lora_B.weight.shape, generator=generator) * 0.05)
        models.append(model)
    return models


def _datums() -> list[Any]:
    from shardforge.algorithms.serve.codecs import WireDatum

    return [
        WireDatum(tokens=t[:-1], inputs={"target_tokens": torch.tensor(t[1:]), "weights": torch.ones(len(t) - 1)})
        for t in TEXTS
    ]


def _loss(logprobs_T: torch.Tensor, datums: list[Any]) -> torch.Tensor:
    return -(logprobs_T * torch.cat([d.inputs["weights"] for d in datums])).sum()


def _trainable(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def _tp_vs_one_rank(model_dir: str) -> dict[str, Any]:
    import torch.distributed as dist

    from shardforge.algorithms.serve.batching import _Rows
    from shardforge.algorithms.serve.tp_lora import TPLoRATree, adapter_grad_group
    from shardforge.algorithms.serve.training import target_logprobs
    from shardforge.engine import EngineConfig
    from shardforge.engine.build import build_model
    from shardforge.engine.context import ParallelContext
    from shardforge.engine.heads import make_head
    from shardforge.engine.loading import load_hf_config
    from shardforge.lora import lora_modules
    from shardforge.mesh import ParallelDims, build_mesh, current_device

    datums = _datums()
    # one process: each tenant alone, the service's padded path
    reference, expected_lp = _tenants(model_dir), []
    for model, (_, _, rows) in zip(reference, TENANTS, strict=True):
        logprobs = target_logprobs(model, datums[rows])
        _loss(logprobs, datums[rows]).backward()
        expected_lp.append(logprobs.detach())
    # tp=2: the engine's TP base, both tenants in one packed batch
    dims = ParallelDims.parse("t2").resolve(dist.get_world_size())
    ctx = ParallelContext(dims=dims, mesh=build_mesh(dims), device=current_device(), config=EngineConfig())
    base, _ = build_model(ctx, make_head("lm"), load_hf_config(model_dir), model_dir)
    base.eval()
    for param in base.parameters():
        param.requires_grad_(False)
    tree, tenants = TPLoRATree(base, tp=dims.tp), _tenants(model_dir)
    plan = [
        _Rows(rows.start, rows.stop, dict(lora_modules(m))) for m, (_, _, rows) in zip(tenants, TENANTS, strict=True)
    ]
    logprobs_T = tree.logprobs(datums, plan)
    lengths = [sum(len(d.tokens) for d in datums[rows]) for _, _, rows in TENANTS]
    parts = logprobs_T.split(lengths)
    loss = sum(_loss(lp, datums[rows]) for lp, (_, _, rows) in zip(parts, TENANTS, strict=True))
    params = [p for m in tenants for p in _trainable(m).values()]
    torch.autograd.backward(loss, inputs=params)  # type: ignore[arg-type]
    local = [{n: p.grad.clone() for n, p in _trainable(m).items()} for m in tenants]  # type: ignore[union-attr]
    group = adapter_grad_group(dims.tp, ctx.dp_group)
    for p in params:
        dist.all_reduce(p.grad, group=group)  # type: ignore[arg-type]
    out: dict[str, Any] = {"logprobs": [], "summed": {}, "local": {}}
    for i, (ref, tp_model) in enumerate(zip(reference, tenants, strict=True)):
        out["logprobs"].append(float(((parts[i].detach() - expected_lp[i]).abs() / expected_lp[i].abs()).max()))
        want = _trainable(ref)
        for name, p in _trainable(tp_model).items():
            scale = float(want[name].grad.abs().max())  # type: ignore[union-attr]
            out["summed"][f"{i}:{name}"] = float((p.grad - want[name].grad).abs().max()) / scale  # type: ignore[operator]
            out["local"][f"{i}:{name}"] = float((local[i][name] - want[name].grad).abs().max()) / scale  # type: ignore[operator]
    return out


def test_tp_adapter_gradients_sum_to_the_one_rank_gradient(lm_dir: str) -> None:
    results = get_rank_pool(2).run(_tp_vs_one_rank, lm_dir, timeout_s=300)
    for rank, result in enumerate(results):
        assert max(result["logprobs"]) < 1e-5, (rank, result["logprobs"])
        assert len(result["summed"]) == 2 * 2 * (2 * 7 + 1)  # tenants x (A, B) x (2 layers x 7 Linears + lm_head)
        worst = max(result["summed"].items(), key=lambda kv: kv[1])
        assert worst[1] < 1e-5, (rank, worst)
    # without the reduction some rank lacks part of every adapter's gradient, for each kind of adapter (a tenant
    # whose tokens all lie in one rank's token shard has its row-parallel B gradient on that rank alone)
    for kind in ("lora_A", "lora_B"):
        for parallel, names in (("column", COLUMN), ("row", ("o_proj", "down_proj"))):
            keys = [k for k in results[0]["local"] if kind in k and any(f".{n}." in k for n in names)]
            shares = {k: max(result["local"][k] for result in results) for k in keys}
            assert shares and min(shares.values()) > 1e-3, (kind, parallel, shares)


def test_a_tp_the_model_cannot_split_is_refused_before_any_rank_starts(lm_dir: str, capsys) -> None:
    from shardforge.algorithms.cli.main import main

    # the tiny Qwen3 has 2 KV heads: tp=4 cannot split them
    assert main(["serve", "--model", lm_dir, "--nproc-per-node", "4", "--layout", "t4"]) == 1
    err = capsys.readouterr().err
    assert "tp=4 must divide num_key_value_heads=2" in err and "valid tp for this model: [1, 2]" in err, err
