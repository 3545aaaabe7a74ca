"""`TrainEngine` at world 1 on CUDA: bf16 SFT steps vs an fp32 CPU reference, NCCL statistics on
CUDA tensors (recorded), activation checkpointing, tiled MLP, AnyPrecisionAdamW and LoRA on CUDA.

Tolerances: a bf16 forward of the tiny Qwen3 gives a loss within 2% of the fp32 CPU loss on the same
weights; feature parity (AC, tiled MLP) on the same device and dtype is exact for AC (same kernels,
recomputed) and 1e-2 relative for the tiled MLP (chunked matmuls round differently in bf16).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import pytest
import torch

if TYPE_CHECKING:
    from shardforge.engine import TrainEngine

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or os.environ.get("SHARDFORGE_GPU_TESTS_ON_CPU") == "1"), reason="no CUDA device"
)


STEPS = 6


def _batch(vocab: int, lengths=(40, 17, 55, 9, 30)):
    """Sequences that repeat a short pattern, so a few steps clearly lower the loss."""
    from shardforge.engine import pack_sequences

    gen = torch.Generator().manual_seed(3)
    seqs = []
    for n in lengths:
        pattern = torch.randint(4, vocab, (5,), generator=gen).tolist()
        seqs.append((pattern * n)[:n])
    return pack_sequences(seqs, [[1.0] * len(s) for s in seqs])


def _engine(model: str, **kwargs) -> TrainEngine:
    from shardforge.engine import EngineConfig, OptimizerConfig, TrainEngine

    opt = kwargs.pop("optimizer", OptimizerConfig(lr=3e-3))
    return TrainEngine(model, "d-1", EngineConfig(optimizer=opt, max_tokens_per_microbatch=96, **kwargs))


def _train(engine: TrainEngine, batch, steps: int = STEPS) -> list[float]:
    return [engine.train_batch(batch)["loss"] for _ in range(steps)]


def _vocab(assets) -> int:
    return len(assets["tokenizer"])


def test_sft_bf16_world1_nccl_learns_and_matches_fp32_cpu(assets, world1, device) -> None:
    from shardforge.algorithms.testing.collective_check import CollectiveRecorder
    from shardforge.engine import EngineConfig, OptimizerConfig, TrainEngine

    batch = _batch(_vocab(assets))
    bf16 = _engine(assets["model"], param_dtype="bfloat16",
                   optimizer=OptimizerConfig(name="anyprecision_adamw", lr=3e-3))  # fmt: skip
    assert bf16.device == device and bf16.mesh is not None
    assert {p.dtype for p in bf16.model.parameters()} == {torch.bfloat16}
    assert all(p.device == device for p in bf16.model.parameters())
    with CollectiveRecorder() as recorder:
        losses = _train(bf16, batch)
    assert recorder.calls, "a 1-rank process group still reduces the step's statistics"
    assert recorder.problems(expected_device=bf16.device) == []
    assert losses[-1] < 0.7 * losses[0], losses
    # The fp32 reference on the CPU, same initial weights: the first loss is the untrained model's.
    reference = TrainEngine(assets["model"], "d-1", EngineConfig(max_tokens_per_microbatch=96))
    cpu_loss = reference.eval_batch(batch)["loss"]
    assert losses[0] == pytest.approx(cpu_loss, rel=2e-2)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_on_cuda_is_exact(assets, device, mode: str) -> None:
    batch = _batch(_vocab(assets))
    plain = _engine(assets["model"], param_dtype="bfloat16")
    ac = _engine(assets["model"], param_dtype="bfloat16", activation_checkpointing=mode, checkpoint_every=1)
    a, b = _train(plain, batch, 2), _train(ac, batch, 2)
    # Recomputation replays the same kernels on the same inputs; only non-deterministic
    # reductions in backward (atomics) could differ, hence a tiny tolerance instead of ==.
    assert a == pytest.approx(b, rel=1e-3, abs=1e-4)


def test_tiled_mlp_on_cuda_matches_untiled(assets, device) -> None:
    batch = _batch(_vocab(assets))
    plain = _engine(assets["model"], param_dtype="bfloat16")
    tiled = _engine(assets["model"], param_dtype="bfloat16", tiled_mlp_shards=4)
    a, b = _train(plain, batch, 3), _train(tiled, batch, 3)
    assert a == pytest.approx(b, rel=1e-2)


@pytest.mark.parametrize("fused", [False, None], ids=["eager", "compiled"])
def test_anyprecision_adamw_cuda_matches_cpu(fused: bool | None) -> None:
    """The optimizer alone, fp32 params, bf16 moments + Kahan: CUDA vs CPU (eager) updates.

    ``fused=None`` compiles the update on CUDA (one kernel per parameter): same arithmetic up to
    reassociation, so a bf16 moment can land one ulp apart (0.4% of one element's update of
    ~lr = 1e-2): atol 2e-4 there, 1e-5 for the eager CUDA update.
    """
    from shardforge.memory import AnyPrecisionAdamW

    if not torch.cuda.is_available():
        pytest.skip("compares a CUDA run with a CPU run (dry run on CPU: nothing to compare)")
    torch.manual_seed(0)
    params = {d: [torch.nn.Parameter(torch.randn(64, 32)), torch.nn.Parameter(torch.randn(32))] for d in ("cpu",)}
    params["cuda"] = [torch.nn.Parameter(p.detach().cuda()) for p in params["cpu"]]
    grads = [[torch.randn_like(p) for p in params["cpu"]] for _ in range(5)]
    for dev, ps in params.items():
        opt = AnyPrecisionAdamW(ps, lr=1e-2, momentum_dtype=torch.bfloat16, variance_dtype=torch.bfloat16,
                                use_kahan_summation=True, compensation_buffer_dtype=torch.bfloat16,
                                fused=fused)  # fmt: skip
        for g in grads:
            for p, gi in zip(ps, g):
                p.grad = gi.to(dev)
            opt.step()
    for a, b in zip(params["cpu"], params["cuda"]):
        tol = 1e-5 if fused is False else 2e-4
        torch.testing.assert_close(b.detach().cpu(), a.detach(), rtol=tol, atol=tol)


def test_lora_on_cuda_trains_only_adapters(assets, device) -> None:
    from shardforge.engine import OptimizerConfig
    from shardforge.lora import LoRAConfig

    batch = _batch(_vocab(assets))
    engine = _engine(
        assets["model"], param_dtype="bfloat16",
        lora=LoRAConfig(r=8, alpha=16, target_modules=("q_proj", "v_proj", "up_proj")),
        optimizer=OptimizerConfig(lr=1e-2),
    )  # fmt: skip
    frozen = {n: p.detach().clone() for n, p in engine.model.named_parameters() if not p.requires_grad}
    assert frozen and all(p.device == device for p in engine.model.parameters())
    losses = _train(engine, batch, 5)
    assert losses[-1] < losses[0], losses
    for n, p in engine.model.named_parameters():
        if n in frozen:
            assert torch.equal(p.detach(), frozen[n]), f"frozen base weight {n} changed"


def test_meta_device_init_then_load_on_cuda(assets, device) -> None:
    """Build on the meta device, materialise on CUDA, load a full state dict: equals the eager model."""
    from transformers import AutoModelForCausalLM

    from shardforge.fsdp_wrap import load_full_state_dict

    eager = AutoModelForCausalLM.from_pretrained(assets["model"], dtype=torch.bfloat16).to(device)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(eager.config, dtype=torch.bfloat16)
    assert all(p.is_meta for p in meta.parameters())
    load_full_state_dict(meta, {k: v.cpu() for k, v in eager.state_dict().items()}, device=device,
                         buffers={k: v.cpu() for k, v in eager.named_buffers()})  # fmt: skip
    for (n, a), b in zip(eager.state_dict().items(), meta.state_dict().values()):
        assert b.device == device, n
        assert torch.equal(a, b), n
    ids = torch.arange(4, 20, device=device)[None]
    with torch.no_grad():
        torch.testing.assert_close(meta(input_ids=ids).logits, eager(input_ids=ids).logits, rtol=0, atol=0)
