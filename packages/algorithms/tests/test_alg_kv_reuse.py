"""KV reuse across turns in the embedded HF engine: multi-turn episodes and partial-rollout chunks give the
same tokens and behaviour log-probs as re-encoding the whole context (greedy and seeded sampling), and a
session's KV is dropped when the weights change (published version or in-place edit), when the episode
ends, when the next prompt does not extend it, and past the token cap (oldest first)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from shardforge.rollout import HFRolloutEngine, SamplingParams
from shardforge.rollout.chunked import ChunkedGeneration
from shardforge.rollout.hf.kv_reuse import KVReuseCache, KVSession
from shardforge.rollout.workflows import PromptRow, WorkflowConfig, build_workflow, run_episodes

ATOL = 1e-5  # float32: the cached prefix and the re-encoded one differ only in reduction order


@pytest.fixture(scope="module")
def chat(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from shardforge.algorithms.testing import tiny_chat_assets

    return tiny_chat_assets(tmp_path_factory.mktemp("kv_chat"), seed=5)


def _engine(chat: dict[str, Any], **kwargs: Any) -> Any:
    return HFRolloutEngine(chat["model"], chat["tokenizer"], **kwargs)


def _rows(prompts: list[str]) -> list[PromptRow]:
    return [PromptRow(index=i, prompt=p, reference="42", prompt_ids=[]) for i, p in enumerate(prompts)]


def _assert_same(got: list[Any], want: list[Any]) -> None:
    assert [t.token_ids for t in got] == [t.token_ids for t in want]
    for a, b in zip(got, want, strict=True):
        assert a.loss_mask == b.loss_mask
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=ATOL, rtol=0)


def _eos_prone(engine: Any, bias: float) -> Any:
    """Raise the EOS logit so some turns end early: batches then mix finished rows (pads after EOS) and full ones."""
    with torch.no_grad():
        engine.model.lm_head.weight[engine.eos_id] += bias
    return engine


@pytest.mark.parametrize(("temperature", "eos_bias"), [(0.0, 0.05), (0.9, 0.6)])
def test_multi_turn_with_kv_reuse_equals_reencoding(chat: dict[str, Any], temperature: float, eos_bias: float) -> None:
    tokenizer = chat["tokenizer"]
    config = WorkflowConfig(name="multi_turn", max_turns=3, chat_template=True)
    workflow = build_workflow(config, tokenizer, lambda p, r, ref: 0.0)
    # Prompts of different lengths: every batch mixes cached lengths (and suffix lengths).
    rows = _rows(["what is 6*7?", "2+2", "name a prime number larger than ten"])
    params = SamplingParams(max_new_tokens=7, temperature=temperature, seed=12)
    reuse, plain = _eos_prone(_engine(chat), eos_bias), _eos_prone(_engine(chat, kv_reuse=False), eos_bias)
    got = run_episodes(workflow, reuse, rows, 2, params, drop_failed=False)
    want = run_episodes(workflow, plain, rows, 2, params, drop_failed=False)
    assert all(len(t.turns) == 3 for t in got)
    assert {turn.finished for t in got for turn in t.turns} == {True, False}, "some turns end on EOS, some do not"
    _assert_same(got, want)
    stats = reuse.kv_cache.stats
    assert stats["hits"] == 6 * 2 and stats["misses"] == 6, stats  # turns 2 and 3 of all 6 episodes reused turn 1's
    assert stats["reused_tokens"] > 0 and plain.kv_cache.stats["hits"] == 0
    assert len(reuse.kv_cache) == 0 and reuse.kv_cache.tokens == 0, "every session is dropped when its episode ends"


def _turn(engine: Any, prompts: list[list[int]], keys: list[Any] | None, seed: int = 1) -> list[Any]:
    return engine.generate(prompts, SamplingParams(max_new_tokens=5, temperature=0.8, seed=seed), sessions=keys)


def _next_prompts(chat: dict[str, Any], prompts: list[list[int]], outs: list[Any]) -> list[list[int]]:
    user = chat["tokenizer"]("\nuser: more", add_special_tokens=False)["input_ids"]
    return [p + o.response_ids + user for p, o in zip(prompts, outs, strict=True)]


def _same_rollouts(got: list[Any], want: list[Any]) -> bool:
    return [r.response_ids for r in got] == [r.response_ids for r in want] and all(
        torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=ATOL, rtol=0)
        for a, b in zip(got, want, strict=True)
    )


def _perturb(model: Any, scale: float = 0.5) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))


def test_a_reused_row_samples_its_own_stream(chat: dict[str, Any]) -> None:
    """Per-request seeds (`SamplingParams.seeds`): a row whose prompt is prefilled from its session's KV samples
    what the same request samples re-encoded, alone or in another batch order."""
    tokenizer = chat["tokenizer"]
    prompts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in ["hi", "one two three", "x y"]]
    reuse, plain = _engine(chat), _engine(chat, kv_reuse=False)
    keys = ["a", "b", "c"]

    def params(*seeds: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=6, temperature=0.9, seeds=seeds)

    nxt = _next_prompts(chat, prompts, reuse.generate(prompts, params(11, 12, 13), sessions=keys))
    got = reuse.generate(nxt, params(21, 22, 23), sessions=keys)
    assert reuse.kv_cache.stats["hits"] == 3
    alone = [plain.generate([p], params(s))[0] for p, s in zip(nxt, (21, 22, 23), strict=True)]
    assert _same_rollouts(got, alone)
    assert _same_rollouts(got[::-1], plain.generate(nxt[::-1], params(23, 22, 21)))
    assert len({tuple(r.response_ids) for r in got}) == 3


def test_a_weight_change_drops_every_cached_session(chat: dict[str, Any], tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from shardforge.weight_sync import DiskTransport, WeightPublisher

    tokenizer = chat["tokenizer"]
    prompts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in ["hello there", "a b c d e f"]]
    keys = ["ep0", "ep1"]
    reuse = _engine(chat, weights_root=tmp_path / "w")
    plain = _engine(chat, weights_root=tmp_path / "w", kv_reuse=False)
    first = _turn(reuse, prompts, keys)
    assert len(reuse.kv_cache) == 2
    second = _next_prompts(chat, prompts, first)
    # 1) A published version (update_weights): the stale KV must not serve the next turn.
    new = AutoModelForCausalLM.from_pretrained(chat["model"])
    _perturb(new)
    WeightPublisher(new, DiskTransport(tmp_path / "w"), bucket_bytes=1 << 16).publish(1)
    assert reuse.update_weights(1) == 1 and plain.update_weights(1) == 1
    held_after_update = len(reuse.kv_cache)
    got = _turn(reuse, second, keys, seed=2)
    assert _same_rollouts(got, _turn(plain, second, None, seed=2))
    assert reuse.kv_cache.stats["hits"] == 0 and reuse.kv_cache.stats["invalidated"] == 2
    assert held_after_update == 0, "update_weights frees the stale KV at once"
    # 2) Weights edited in place with no version bump (load_state_dict, an in-memory publish): the same.
    third = _next_prompts(chat, second, got)
    _perturb(reuse.model, 0.3)
    _perturb(plain.model, 0.3)
    assert reuse.version == 1 and len(reuse.kv_cache) == 2
    got = _turn(reuse, third, keys, seed=4)
    assert _same_rollouts(got, _turn(plain, third, None, seed=4))
    assert reuse.kv_cache.stats["hits"] == 0 and reuse.kv_cache.stats["invalidated"] == 4
    # Unchanged weights: the next turn reuses (and still equals re-encoding).
    fourth = _next_prompts(chat, third, got)
    assert _same_rollouts(_turn(reuse, fourth, keys, seed=5), _turn(plain, fourth, None, seed=5))
    assert reuse.kv_cache.stats["hits"] == 2


def test_a_prompt_that_does_not_extend_the_session_is_reencoded(chat: dict[str, Any]) -> None:
    tokenizer = chat["tokenizer"]
    prompts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in ["first question", "second one"]]
    reuse, plain = _engine(chat), _engine(chat, kv_reuse=False)
    first = _turn(reuse, prompts, ["a", "b"])
    extended = _next_prompts(chat, prompts, first)
    edited = list(extended[1])
    edited[2] = tokenizer("Z", add_special_tokens=False)["input_ids"][0]  # history rewritten: no longer a prefix
    nxt = [extended[0], edited]
    got = _turn(reuse, nxt, ["a", "b"], seed=7)
    assert _same_rollouts(got, _turn(plain, nxt, None, seed=7))
    assert reuse.kv_cache.stats["hits"] == 1 and reuse.kv_cache.stats["misses"] == 3  # 2 first turns + "b"
    # The same prompt again (nothing new to prefill) is a miss too; both sessions now hold the new turn.
    again = _turn(reuse, [g.prompt_ids + g.response_ids[:-1] for g in got], ["a", "b"], seed=8)
    assert reuse.kv_cache.stats["hits"] == 1 and reuse.kv_cache.stats["misses"] == 5 and len(again) == 2
    reuse.end_sessions(["a"])
    assert "a" not in reuse.kv_cache and "b" in reuse.kv_cache
    with pytest.raises(ValueError, match="one key per prompt"):
        reuse.generate(prompts, SamplingParams(n=2), sessions=["a", "b"])


def test_the_token_cap_evicts_the_oldest_sessions(chat: dict[str, Any]) -> None:
    def session(n: int) -> KVSession:
        return KVSession(ids=list(range(n)), layers=[(torch.zeros(2, n, 4), torch.zeros(2, n, 4))])

    cache = KVReuseCache(max_tokens=10)
    cache.put("a", session(4))
    cache.put("b", session(4))
    cache.put("c", session(4))  # 12 > 10: "a" (the oldest) goes
    assert "a" not in cache and "b" in cache and "c" in cache and cache.tokens == 8
    cache.put("b", session(5))  # replacing a session makes it the newest: "c" is now the oldest
    cache.put("d", session(3))
    assert "c" not in cache and "b" in cache and "d" in cache and cache.tokens == 8
    cache.put("e", session(11))  # larger than the cap on its own: not kept, and nothing else is evicted for it
    assert "e" not in cache and len(cache) == 2 and cache.tokens == 8 and cache.stats["evicted"] == 3
    with pytest.raises(ValueError, match="must be >= 1"):
        KVReuseCache(max_tokens=0)
    # The engine honours its cap: three sessions of ~10-16 tokens under a 30-token cap keep the newest two.
    tokenizer = chat["tokenizer"]
    engine = _engine(chat, kv_reuse_max_tokens=30)
    prompts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in ["abcdefghij", "klmnop", "qrstuvw"]]
    _turn(engine, prompts, ["x", "y", "z"])
    assert "x" not in engine.kv_cache and "z" in engine.kv_cache and engine.kv_cache.tokens <= 30


def test_partial_rollout_chunks_reuse_the_cache_and_equal_reencoding(chat: dict[str, Any]) -> None:
    tokenizer = chat["tokenizer"]
    prompts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in ["one", "two three four", "five six"]]
    params = SamplingParams(n=2, max_new_tokens=9, temperature=0.9, seed=6)
    outs = []
    for kv_reuse in (True, False):
        chunks = ChunkedGeneration(3)
        engine = _engine(chat, kv_reuse=kv_reuse, chunks=chunks)
        switches: list[int] = []

        def switch(engine: Any = engine, switches: list[int] = switches) -> None:
            switches.append(1)
            if len(switches) == 2:  # new weights between chunks 2 and 3: the cached context is stale
                _perturb(engine.model, 0.3)

        with chunks.refreshing(switch):
            outs.append(engine.generate(prompts, params))
        if kv_reuse:
            assert engine.kv_cache.stats["hits"] > 0 and engine.kv_cache.stats["invalidated"] > 0
            assert len(engine.kv_cache) == 0, "a chunked call's own sessions end with it"
    assert _same_rollouts(outs[0], outs[1])


def test_the_trainer_knobs_reach_the_embedded_engine(chat: dict[str, Any]) -> None:
    from shardforge.algorithms.config_io import apply_overrides, build_config
    from shardforge.algorithms.trainers.grpo import GRPOConfig
    from shardforge.rollout.factory import build_rollout_engine

    data = {"model": chat["model"], "train_file": "unused.jsonl", "output_dir": "unused"}
    assert build_config(GRPOConfig, data).rollout.kv_reuse, "on by default"
    config = build_config(
        GRPOConfig, apply_overrides(data, ["rollout.kv_reuse=false", "rollout.kv_reuse_max_tokens=100"])
    )
    engine = build_rollout_engine(config.rollout, chat["model"], chat["tokenizer"])
    assert isinstance(engine, HFRolloutEngine)
    assert engine.kv_reuse is False and engine.kv_cache.max_tokens == 100
    tokenizer = chat["tokenizer"]
    prompt = tokenizer("hi", add_special_tokens=False)["input_ids"]
    out = _turn(engine, [prompt], ["s"])
    _turn(engine, _next_prompts(chat, [prompt], out), ["s"])
    assert len(engine.kv_cache) == 0 and engine.kv_cache.stats["hits"] == 0, "off: nothing is cached"
