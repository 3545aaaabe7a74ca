"""`TrainEngine` in one process (world size 1, no process group) against a plain HF model."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, Qwen3Config

from shardforge.engine import EngineConfig, OptimizerConfig, TrainEngine, pack_sequences
from shardforge.engine.checks import check_layout as validate_layout
from shardforge.mesh import ParallelDims

VOCAB = 64


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


def tiny_config(**overrides) -> Qwen3Config:
    kwargs = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "max_position_embeddings": 64,
        "tie_word_embeddings": False,
    }
    kwargs.update(overrides)
    return Qwen3Config(**kwargs)


def plain_model(cfg: Qwen3Config) -> torch.nn.Module:
    """The same weights the engine makes: EngineConfig.seed=0, then `from_config`."""
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(copy.deepcopy(cfg)).eval()


def make_data(lengths: list[int], seed: int = 0) -> tuple[list[list[int]], list[list[float]]]:
    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lengths]
    masks = [[float(t % 3 != 1) for t in range(n)] for n in lengths]  # some targets masked out
    return seqs, masks


def reference_logprobs(model: torch.nn.Module, seqs: list[list[int]]) -> torch.Tensor:
    """Target log-probs per token, one unpacked forward per sequence (0 at starts)."""
    out = []
    with torch.no_grad():
        for seq in seqs:
            ids = torch.tensor([seq])
            logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
            picked = logp[:-1].gather(1, ids[0, 1:, None])[:, 0]
            out.append(torch.cat([torch.zeros(1), picked]))
    return torch.cat(out)


def reference_loss(model, seqs, masks) -> float:
    """Mean NLL over target tokens (the first token of a sequence is never a target)."""
    logprobs = reference_logprobs(model, seqs)
    mask = torch.cat([torch.tensor([0.0, *m[1:]]) for m in masks])
    return float(-(logprobs * mask).sum() / mask.sum())


def engine(cfg=None, **kwargs) -> TrainEngine:
    config = EngineConfig(**{"optimizer": OptimizerConfig(lr=1e-3), **kwargs})
    return TrainEngine(cfg if cfg is not None else tiny_config(), "d-1", config)


LENGTHS = [3, 12, 5, 10, 4]  # budget 16 -> FFD bins [[0], [1, 4], [2, 3]]: sequence order changes


# ------------------------------------------------------------------------------------------ construction
def test_engine_from_config_matches_seeded_plain_model_and_leaves_config_alone():
    cfg = tiny_config()
    eng = engine(cfg)
    assert not dist.is_initialized() and eng.mesh is None
    assert (eng.dims.world_size, eng.dp_size, eng.dp_rank, eng.is_main) == (1, 1, 0, True)
    ref = plain_model(cfg)
    ref_params = dict(ref.named_parameters())
    for name, param in eng.model.named_parameters():
        assert torch.equal(param.detach(), ref_params[name].detach()), name
    # The engine sets packed attention and use_cache=False on its own copy only.
    assert cfg.use_cache is True
    assert cfg._attn_implementation != "shardforge_packed"


def test_engine_from_model_dir_loads_the_weights(tmp_path):
    cfg = tiny_config()
    torch.manual_seed(123)  # not the engine's seed: the weights must come from disk
    saved = AutoModelForCausalLM.from_config(cfg)
    saved.save_pretrained(tmp_path / "model")
    eng = TrainEngine(str(tmp_path / "model"), ParallelDims(dp_shard=1, tp=1), EngineConfig())
    for name, param in saved.named_parameters():
        assert torch.equal(eng.model.get_parameter(name).detach(), param.detach()), name


# ------------------------------------------------------------------------------------------ train / eval / forward
def test_train_batch_loss_equals_plain_hf_mean_nll():
    cfg = tiny_config()
    seqs, masks = make_data(LENGTHS)
    expected = reference_loss(plain_model(cfg), seqs, masks)
    eng = engine(cfg)
    stats = eng.train_batch(pack_sequences(seqs, masks))
    # Packed blockwise SDPA vs one plain SDPA forward per sequence, float32.
    assert stats["loss"] == pytest.approx(expected, rel=1e-5)
    targets = sum(sum(m[1:]) for m in masks)
    assert stats["loss_weight"] == targets
    assert stats["tokens"] == sum(LENGTHS)
    assert stats["lr"] == pytest.approx(1e-3)
    assert stats["skipped"] == 0.0 and stats["grad_norm"] > 0
    assert eng.step == 1


def test_one_step_is_independent_of_micro_batching():
    cfg = tiny_config()
    seqs, masks = make_data(LENGTHS, seed=1)
    small = engine(cfg, max_tokens_per_microbatch=16)
    big = engine(cfg, max_tokens_per_microbatch=4096)
    initial = {n: p.detach().clone() for n, p in big.model.named_parameters()}
    s_small = small.train_batch(pack_sequences(seqs, masks))
    s_big = big.train_batch(pack_sequences(seqs, masks))
    assert (s_small["microbatches"], s_big["microbatches"]) == (3.0, 1.0)
    # Only the float32 summation order differs between the two.
    assert s_small["loss"] == pytest.approx(s_big["loss"], rel=1e-6)
    assert s_small["grad_norm"] == pytest.approx(s_big["grad_norm"], rel=1e-5)
    moved = 0.0
    for name, p_big in big.model.named_parameters():
        p_small = small.model.get_parameter(name)
        # Gradients agree to ~2e-8 (float32 summation order). Adam's first step is about
        # lr * g / (|g| + eps), which turns that into up to ~3e-6 for entries with |g| near
        # eps=1e-8; 1e-5 is 1% of the lr = 1e-3 step every weight takes.
        torch.testing.assert_close(p_small.detach(), p_big.detach(), rtol=0, atol=1e-5, msg=name)
        moved = max(moved, float((p_big.detach() - initial[name]).abs().max()))
    assert moved > 5e-4, "the step must actually change the weights"


def test_forward_returns_logprobs_in_original_token_order():
    cfg = tiny_config()
    seqs, masks = make_data(LENGTHS, seed=2)
    expected = reference_logprobs(plain_model(cfg), seqs)
    eng = engine(cfg, max_tokens_per_microbatch=16)
    batch = pack_sequences(seqs, masks)
    assert [i for i, _ in eng.runner.microbatches(batch).items] == [[0], [1, 4], [2, 3]]
    got = eng.forward(batch)
    assert got.shape == (sum(LENGTHS),)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_eval_batch_matches_and_does_not_update():
    cfg = tiny_config()
    seqs, masks = make_data(LENGTHS, seed=3)
    expected = reference_loss(plain_model(cfg), seqs, masks)
    eng = engine(cfg, max_tokens_per_microbatch=16)
    before = {n: p.detach().clone() for n, p in eng.model.named_parameters()}
    stats = eng.eval_batch(pack_sequences(seqs, masks))
    assert stats["loss"] == pytest.approx(expected, rel=1e-5)
    assert stats["loss_weight"] == sum(sum(m[1:]) for m in masks)
    assert all(torch.equal(p, before[n]) for n, p in eng.model.named_parameters())
    assert eng.step == 0


def test_training_reduces_the_loss_on_a_repeated_batch():
    seqs, masks = make_data([6, 7], seed=4)
    eng = engine(optimizer=OptimizerConfig(lr=1e-2))
    batch = pack_sequences(seqs, masks)
    losses = [eng.train_batch(batch)["loss"] for _ in range(5)]
    assert losses[-1] < losses[0] - 0.1


def test_an_all_zero_gradient_leaves_weights_and_optimizer_state_alone():
    # RL batches where no sequence carries an advantage give exactly zero gradients: AdamW would
    # still move every weight by ~lr on its momentum, so the engine skips the optimizer step (the
    # LR schedule and the step count still advance).
    seqs, masks = make_data([6, 7], seed=4)
    eng = engine(optimizer=OptimizerConfig(lr=1e-2))
    batch = pack_sequences(seqs, masks)
    first = eng.train_batch(batch)
    assert first["zero_grad_skipped"] == 0.0 and first["grad_norm"] > 0
    before = {n: p.detach().clone() for n, p in eng.model.named_parameters()}
    adam_steps = [float(s["step"]) for s in eng.optimizer.state.values()]

    def no_signal(logprobs, mb):  # an advantage of zero on every token
        return (logprobs * mb.loss_mask).sum() * 0.0

    stats = eng.train_batch(batch, loss_fn=no_signal)
    assert stats["grad_norm"] == 0.0 and stats["zero_grad_skipped"] == 1.0 and stats["skipped"] == 0.0
    assert eng.step == 2
    for n, p in eng.model.named_parameters():
        assert torch.equal(p, before[n]), n
    assert [float(s["step"]) for s in eng.optimizer.state.values()] == adam_steps
    # Without the skip, AdamW's momentum alone would have moved the weights:
    moved = engine(optimizer=OptimizerConfig(lr=1e-2))
    moved.train_batch(batch)
    weight = next(moved.model.parameters())
    snapshot = weight.detach().clone()
    moved.optimizer.zero_grad()
    for p in moved.model.parameters():
        p.grad = torch.zeros_like(p)
    moved.optimizer.step()
    assert not torch.equal(weight, snapshot)


def test_zero_weight_batch_raises():
    eng = engine()
    batch = pack_sequences([[1, 2, 3], [4, 5]], [[0, 0, 0], [0, 0]])
    with pytest.raises(ValueError, match="zero loss weight"):
        eng.train_batch(batch)
    assert eng.step == 0


# ------------------------------------------------------------------------------------------ input errors
def test_missing_model_dir(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist; pass a directory written by `save_pretrained`"):
        TrainEngine(str(tmp_path / "nope"))


def test_model_dir_without_config_json(tmp_path):
    (tmp_path / "weights.bin").write_text("x")
    with pytest.raises(FileNotFoundError, match=r"has no config.json \(found: \['weights.bin'\]\)"):
        TrainEngine(str(tmp_path))


def test_model_of_wrong_type():
    with pytest.raises(TypeError, match="HF model directory or a PretrainedConfig, got int"):
        TrainEngine(5)


def test_layout_of_wrong_world_size_raises_before_anything_runs():
    with pytest.raises(ValueError, match="world_size=1"):
        TrainEngine(tiny_config(), "d2")
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    ("settings", "pattern"),
    [
        ({"pp_layers_per_stage": (2, 1)}, r"layers_per_stage=\[2, 1\] must list 2 counts >= 1 that sum to 2"),
        ({"pp_schedule": "pipedream"}, r"unknown pipeline schedule 'pipedream'"),
        ({"pp_schedule": "Interleaved1F1B"}, r"cannot split 2 decoder layers into 4 stages"),
    ],
)
def test_bad_pipeline_settings_raise_before_any_process_group(monkeypatch, settings, pattern):
    # The engine reads the world size from WORLD_SIZE when no process group exists yet, and
    # validates the layout (and pipeline settings) before init_distributed, so nothing starts here.
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=pattern):
        TrainEngine(tiny_config(), "p2", EngineConfig(**settings))
    assert not dist.is_initialized()


def test_expert_parallel_on_a_dense_model_raises(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"ep=2 needs a sparse MoE model .*got model_type='qwen3'; use ep=1"):
        TrainEngine(tiny_config(), "d2e2")


def test_trivial_parallel_dims_object_is_fine():
    eng = TrainEngine(tiny_config(), ParallelDims(dp_shard=1, tp=1))
    assert eng.dims == ParallelDims(dp_shard=1)


@pytest.mark.parametrize(
    ("dims", "pattern"),
    [
        # tiny_config: 4 heads, 2 kv heads, intermediate 64, vocab 64 -> tp in {1, 2}.
        (ParallelDims(dp_shard=1, tp=3), r"tp=3 must divide num_attention_heads=4 .*valid tp for this model: \[1, 2\]"),
        (ParallelDims(dp_shard=1, tp=4), r"tp=4 must divide num_key_value_heads=2 .*valid tp for this model: \[1, 2\]"),
        (ParallelDims(dp_shard=1, cp=3), r"cp=3 does not fit 4 query / 2 key-value heads.*valid cp: \[1, 2, 4\]"),
        (ParallelDims(dp_shard=1, tp=2, cp=4), r"cp=4 does not fit 2 query / 1 key-value heads per TP rank"),
        (ParallelDims(dp_shard=1, pp=3), r"pp=3 needs at least one decoder layer per stage .* 2 layers"),
        (ParallelDims(dp_shard=4, ep=2), r"ep=2 needs a sparse MoE model .*got model_type='qwen3'"),
    ],
)
def test_validate_layout_against_the_model(dims, pattern):
    with pytest.raises(ValueError, match=pattern):
        validate_layout(dims, tiny_config())


def test_validate_layout_expert_divisibility():
    moe = SimpleNamespace(
        model_type="qwen3_moe", num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=2, num_experts=6
    )
    with pytest.raises(ValueError, match=r"ep=4 must divide num_experts=6; valid ep: \[1, 2, 3, 6\]"):
        validate_layout(ParallelDims(dp_shard=4, ep=4), moe)
    validate_layout(ParallelDims(dp_shard=2, ep=2), moe)  # expert parallelism is available
    validate_layout(ParallelDims(dp_shard=8, dp_replicate=2), moe)  # FSDP/HSDP only: fine


# ------------------------------------------------------------------------------------------ export
@pytest.mark.parametrize("tied", [False, True])
def test_export_hf_round_trips(tmp_path, tied):
    eng = engine(tiny_config(tie_word_embeddings=tied), optimizer=OptimizerConfig(lr=1e-2))
    seqs, masks = make_data([5, 6], seed=5)
    eng.train_batch(pack_sequences(seqs, masks))  # export the trained weights, not the initial ones
    eng.export_hf(tmp_path / "hf")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert loaded.config.tie_word_embeddings is tied
    ids = torch.tensor([seqs[0] + seqs[1]])
    eng.model.eval()
    with torch.no_grad():
        expected = eng.model(input_ids=ids).logits
        got = loaded(input_ids=ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    untrained = plain_model(tiny_config(tie_word_embeddings=tied))
    with torch.no_grad():
        assert not torch.allclose(untrained(input_ids=ids).logits, got, atol=1e-3)


def test_ddp_is_refused_on_sharded_layouts():
    from shardforge.engine import EngineConfig
    from shardforge.engine.checks import check_engine

    for layout in ("d4", "r2d2", "r2t2"):
        with pytest.raises(ValueError, match="data_parallel=ddp keeps a whole replica"):
            check_engine(ParallelDims.parse(layout).resolve(4), tiny_config(), EngineConfig(data_parallel="ddp"))
    check_engine(ParallelDims.parse("r4").resolve(4), tiny_config(), EngineConfig(data_parallel="ddp"))
    with pytest.raises(ValueError, match="cpu_offload needs data_parallel=fsdp"):
        check_engine(
            ParallelDims.parse("r2").resolve(2), tiny_config(), EngineConfig(data_parallel="ddp", cpu_offload=True)
        )
    with pytest.raises(ValueError, match="unknown data_parallel 'zero'"):
        EngineConfig(data_parallel="zero")  # type: ignore[arg-type]


def test_world1_warns_about_settings_only_fsdp_applies(caplog):
    # One process builds a plain model: compute_dtype and cpu_offload would do nothing silently.
    with caplog.at_level("WARNING", logger="shardforge.engine.train_engine"):
        TrainEngine(tiny_config(), "d1", EngineConfig(compute_dtype="bfloat16", cpu_offload=True))
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1, warnings
    assert "engine.compute_dtype=bfloat16" in warnings[0] and "engine.cpu_offload=true" in warnings[0]
    assert "--nproc-per-node" in warnings[0]
    caplog.clear()
    with caplog.at_level("WARNING", logger="shardforge.engine.train_engine"):
        TrainEngine(tiny_config(), "d1", EngineConfig(compute_dtype="float32"))  # same as param_dtype: nothing lost
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
