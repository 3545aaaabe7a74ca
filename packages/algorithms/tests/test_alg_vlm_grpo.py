"""GRPO with image prompts (tiny Qwen2.5-VL / Qwen3-VL): the embedded HF rollout engine generates from the
prompts' images, the trainer's log-probs of the sampled tokens equal the engine's behaviour log-probs (and
depend on the pixels), FSDP 2 matches world 1 step for step, the trainer runs from a config, and what is
not supported is refused with a message."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from shardforge.algorithms.testing.vlm import vlm_grpo_steps
from shardforge.mesh.testing import get_rank_pool


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from shardforge.algorithms.testing.vlm import tiny_vlm_assets

    return tiny_vlm_assets(tmp_path_factory.mktemp("vlm_grpo"), seed=0, num_train=4, num_eval=2)


def _prompts(assets: dict[str, Any], split: str = "train") -> Any:
    from transformers import AutoImageProcessor, AutoTokenizer

    from shardforge.algorithms.data.prompts import load_image_prompts

    tokenizer = AutoTokenizer.from_pretrained(assets["model"])
    processor = AutoImageProcessor.from_pretrained(assets["model"])
    return load_image_prompts(assets[split], tokenizer, processor, image_token="<|image_pad|>"), tokenizer


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_trainer_logprobs_equal_the_engines_behaviour_logprobs(tmp_path: Path, family: str) -> None:
    from shardforge.algorithms.testing.vlm import colour_overlap_reward, tiny_vlm_assets
    from shardforge.algorithms.trainers.rl.batch import trajectories_to_batch
    from shardforge.engine import EngineConfig, TrainEngine
    from shardforge.engine.batching.visual import VLM_PIXELS
    from shardforge.engine.objectives.rollout_correction import BEHAVIOUR_LOGPROBS
    from shardforge.rollout import SamplingParams
    from shardforge.rollout.hf.engine import HFRolloutEngine
    from shardforge.rollout.workflows import PromptRow, WorkflowConfig, run_episodes
    from shardforge.rollout.workflows.rlvr import RLVRWorkflow

    # Sharp initial weights: outputs depend visibly on positions and images (see tiny_qwen2_5_vl_config).
    assets = tiny_vlm_assets(tmp_path, seed=1, num_train=4, num_eval=1, initializer_range=0.2, family=family)
    prompts, tokenizer = _prompts(assets)
    assert {p.num_images for p in prompts.images} == {1, 2} and len({len(i) for i in prompts.ids}) > 1
    assert prompts.references[2] == "blue yellow" and prompts.texts[2] == "colours?"
    rows = [
        PromptRow(index=i, prompt=prompts.texts[i], reference=prompts.references[i], prompt_ids=prompts.ids[i],
                  images=prompts.image(i))
        for i in range(len(prompts))
    ]  # fmt: skip
    text_chat = [{"role": "user", "content": "say red"}]  # a text-only row in the same batch: no images
    text_ids = tokenizer.apply_chat_template(text_chat, add_generation_prompt=True, tokenize=True)
    rows.append(PromptRow(index=len(rows), prompt="say red", reference="red", prompt_ids=list(text_ids["input_ids"])))
    workflow = RLVRWorkflow(WorkflowConfig(), tokenizer, colour_overlap_reward)
    # One batched generate: prompts of different lengths (0, 1 and 2 images) are left-padded together.
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=0)
    trajectories = run_episodes(workflow, HFRolloutEngine(assets["model"], tokenizer), rows, 2, params)
    batch = trajectories_to_batch(trajectories, torch.zeros(len(trajectories)))
    engine = TrainEngine(assets["model"], "d1", EngineConfig())
    trained = engine.forward(batch)
    mask = batch.loss_mask != 0
    gap = (trained - batch.extras[BEHAVIOUR_LOGPROBS])[mask].abs().max()
    # fp32; a packed forward vs the engine's cached, left-padded decoding: rounding only.
    assert mask.sum() >= 8 and gap < 1e-4, f"trainer vs engine log-probs differ by {gap}"
    batch.extras[VLM_PIXELS].zero_()
    blind = (engine.forward(batch) - trained)[mask].abs().max()
    assert blind > 1e-2, f"zeroed pixels change the log-probs by only {blind}: the images are not used"


def test_vlm_grpo_world1_matches_fsdp2(vlm: dict[str, Any]) -> None:
    from transformers import AutoModelForImageTextToText

    single = vlm_grpo_steps(vlm["model"], str(vlm["train"]), "d1")
    ranks = get_rank_pool(2).run(vlm_grpo_steps, vlm["model"], str(vlm["train"]), "d2", timeout_s=600)
    sharded = ranks[0]
    # Every rank samples the same responses as world 1 (step 2: from the weights published after step 1) ...
    assert all(r["rewards"] == single["rewards"] for r in ranks), [r["rewards"] for r in ranks]
    gaps = single["gaps"] + [g for r in ranks for g in r["gaps"]]
    assert max(gaps) < 1e-4, gaps
    # ... and train the same: fp32, FSDP reduce-scatters gradients in another order than one process sums them.
    torch.testing.assert_close(torch.tensor(sharded["losses"]), torch.tensor(single["losses"]), rtol=1e-5, atol=1e-7)
    initial = AutoModelForImageTextToText.from_pretrained(vlm["model"]).state_dict()
    moved = [k for k, v in single["weights"].items() if (v - initial[k]).abs().max() > 1e-4]
    assert any(k.startswith("model.visual.") for k in moved), "the steps carry a learning signal to the vision tower"
    for key, value in sharded["weights"].items():
        torch.testing.assert_close(value, single["weights"][key], rtol=0, atol=2e-5, msg=key)


@pytest.mark.heavy  # ~60 s loaded (world 1 + 2 ranks); CI keeps the FSDP 2 test above and the c2 / t2 SFT parity
@pytest.mark.parametrize(("layout", "family"), [("c2", "qwen3_vl"), ("t2", "qwen2_5_vl")])
def test_vlm_grpo_world1_matches_cp2_and_tp2(tmp_path: Path, layout: str, family: str) -> None:
    """GRPO with image prompts under Ulysses CP 2 (Qwen3-VL, DeepStack) and TP 2 with sequence parallelism
    (Qwen2.5-VL) vs one process: the same rollouts, trainer-vs-engine gaps, losses and weights."""
    from shardforge.algorithms.testing.vlm import tiny_vlm_assets

    assets = tiny_vlm_assets(tmp_path, seed=0, num_train=4, num_eval=1, family=family, vocab_size=112)
    single = vlm_grpo_steps(assets["model"], str(assets["train"]), "d1")
    ranks = get_rank_pool(2).run(vlm_grpo_steps, assets["model"], str(assets["train"]), layout, timeout_s=600)
    assert all(r["rewards"] == single["rewards"] for r in ranks), [r["rewards"] for r in ranks]
    gaps = single["gaps"] + [g for r in ranks for g in r["gaps"]]
    assert max(gaps) < 1e-4, gaps
    # fp32; CP / TP sum partial attention and matmul results in another order: rounding only.
    torch.testing.assert_close(torch.tensor(ranks[0]["losses"]), torch.tensor(single["losses"]), rtol=1e-5, atol=1e-7)
    for key, value in ranks[0]["weights"].items():
        torch.testing.assert_close(value, single["weights"][key], rtol=0, atol=2e-5, msg=key)


def test_multi_turn_episodes_keep_the_images_in_every_turn(vlm: dict[str, Any]) -> None:
    """multi_turn (chat template, feedback turns): every turn generates with the prompt's images and the
    trainer scores the whole episode as the engine sampled it."""
    from shardforge.algorithms.trainers.rl.batch import trajectories_to_batch
    from shardforge.engine import EngineConfig, TrainEngine
    from shardforge.engine.objectives.rollout_correction import BEHAVIOUR_LOGPROBS
    from shardforge.rollout import SamplingParams
    from shardforge.rollout.hf.engine import HFRolloutEngine
    from shardforge.rollout.workflows import PromptRow, WorkflowConfig, run_episodes
    from shardforge.rollout.workflows.multi_turn import MultiTurnWorkflow

    prompts, tokenizer = _prompts(vlm)
    rows = [
        PromptRow(index=i, prompt=prompts.texts[i], reference=prompts.references[i], prompt_ids=prompts.ids[i],
                  images=prompts.image(i))
        for i in range(2)
    ]  # fmt: skip
    config = WorkflowConfig(name="multi_turn", max_turns=2, chat_template=True)
    workflow = MultiTurnWorkflow(config, tokenizer, lambda prompt, response, reference: 0.0)
    params = SamplingParams(max_new_tokens=4, temperature=1.0, seed=0)
    trajectories = run_episodes(workflow, HFRolloutEngine(vlm["model"], tokenizer), rows, 2, params)
    assert all(len(t.turns) == 2 and t.images is rows[t.group].images for t in trajectories)
    assert trajectories[0].token_ids[: len(rows[0].prompt_ids)] == rows[0].prompt_ids  # not re-rendered
    batch = trajectories_to_batch(trajectories, torch.zeros(len(trajectories)))
    mask = batch.loss_mask != 0
    gap = (TrainEngine(vlm["model"], "d1", EngineConfig()).forward(batch) - batch.extras[BEHAVIOUR_LOGPROBS])[mask]
    assert mask.sum() >= 8 and gap.abs().max() < 1e-4, gap.abs().max()


def test_unsupported_image_prompt_settings_are_refused(vlm: dict[str, Any], tmp_path: Path) -> None:
    from shardforge.algorithms.config_io import apply_overrides, build_config
    from shardforge.algorithms.trainers.grpo import GRPOConfig
    from shardforge.algorithms.trainers.ppo import PPOConfig, _validate
    from shardforge.algorithms.trainers.rl.common import check_rollout_batch
    from shardforge.rollout import SamplingParams
    from shardforge.rollout.types import generate_rollouts

    prompts, _ = _prompts(vlm)
    base = {"model": vlm["model"], "train_file": str(vlm["train"]), "output_dir": str(tmp_path), "prompts_per_step": 2}

    def grpo(*overrides: str) -> Any:
        return build_config(GRPOConfig, apply_overrides(base, list(overrides)))

    check_rollout_batch(grpo(), prompts, 1, 1024, "budget")
    with pytest.raises(ValueError, match=r"embedded HF engine only; rollout\.engine='vllm'"):
        check_rollout_batch(grpo("rollout.engine=vllm"), prompts, 1, 1024, "budget")
    with pytest.raises(ValueError, match=r"rollout\.partial_rollouts"):
        check_rollout_batch(grpo("rollout.partial_rollouts=true"), prompts, 1, 1024, "budget")
    with pytest.raises(ValueError, match="system message in the rows"):
        check_rollout_batch(grpo("workflow.system_prompt=be brief"), prompts, 1, 1024, "budget")
    _validate(build_config(PPOConfig, base), prompts, 1)  # PPO takes image prompts (critic: engine.vision_value)
    with pytest.raises(ValueError, match="embedded HF engine only"):
        _validate(build_config(PPOConfig, {**base, "rollout.engine": "vllm"}), prompts, 1)

    class TextOnly:  # a rollout engine without `accepts_images`
        def generate(self, prompts: Any, params: Any) -> list[Any]:
            raise AssertionError("not called")

    with pytest.raises(ValueError, match="TextOnly cannot generate from image prompts"):
        generate_rollouts(TextOnly(), prompts.ids[:1], SamplingParams(), prompts.images[:1])  # type: ignore[arg-type]


def test_engine_never_samples_the_image_placeholder(vlm: dict[str, Any]) -> None:
    """A sampled image token would reach the trainer as an image without pixels: the engine suppresses it,
    and its behaviour log-probs stay those of the full softmax (what the trainer computes)."""
    from shardforge.rollout import SamplingParams
    from shardforge.rollout.hf.engine import HFRolloutEngine

    prompts, tokenizer = _prompts(vlm)
    rollout = HFRolloutEngine(vlm["model"], tokenizer)
    image_id = rollout.image_token_id
    assert image_id is not None

    def favour_image_token(module: Any, args: Any, logits: torch.Tensor) -> torch.Tensor:
        logits = logits.clone()
        logits[..., image_id] += 20.0
        return logits

    rollout.model.lm_head.register_forward_hook(favour_image_token)
    outs = rollout.generate(prompts.ids[:2], SamplingParams(n=4, max_new_tokens=4, seed=0), images=prompts.images[:2])
    assert all(image_id not in o.response_ids for o in outs)
    assert max(max(o.logprobs) for o in outs) < -10.0, "log-probs of the unsuppressed softmax (the image token's mass)"


def test_image_rows_sample_from_their_own_seeds(vlm: dict[str, Any]) -> None:
    """Per-request seeds with image prompts: an image row samples the same alone as in a batch with other rows."""
    from shardforge.rollout import SamplingParams
    from shardforge.rollout.hf.engine import HFRolloutEngine

    prompts, tokenizer = _prompts(vlm)
    engine = HFRolloutEngine(vlm["model"], tokenizer)

    def params(*seeds: int) -> SamplingParams:
        return SamplingParams(n=2, max_new_tokens=5, temperature=1.0, seeds=seeds)

    both = engine.generate(prompts.ids[:2], params(3, 4), images=prompts.images[:2])
    alone = engine.generate(prompts.ids[1:2], params(4), images=prompts.images[1:2])
    assert [r.response_ids for r in both[2:]] == [r.response_ids for r in alone]
    for a, b in zip(both[2:], alone, strict=True):
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)
    again = engine.generate(prompts.ids[1:2], params(5), images=prompts.images[1:2])
    assert [r.response_ids for r in again] != [r.response_ids for r in alone], "another seed, other samples"


def test_image_prompt_rows_and_trajectory_state(vlm: dict[str, Any], tmp_path: Path) -> None:
    """A row ending on the user's turn takes its reference from ``completion``; one without a reference is
    refused with its file and line; a trajectory's images survive the async checkpoint state (JSON)."""
    import json

    from transformers import AutoImageProcessor

    from shardforge.algorithms.data.prompts import load_image_prompts
    from shardforge.rollout.episodes.trajectory import Trajectory

    prompts, tokenizer = _prompts(vlm)
    rows = [json.loads(line) for line in Path(vlm["train"]).read_text().splitlines()]
    user_only = {"messages": rows[0]["messages"][:-1], "completion": rows[0]["messages"][-1]["content"]}
    data = Path(vlm["train"]).parent / "user_only.jsonl"
    data.write_text(json.dumps(user_only) + "\n" + json.dumps({"messages": rows[1]["messages"][:-1]}) + "\n")
    processor = AutoImageProcessor.from_pretrained(vlm["model"])
    with pytest.raises(ValueError, match=r"user_only.jsonl:2: an image prompt row needs its reference"):
        load_image_prompts(data, tokenizer, processor, image_token="<|image_pad|>")
    data.write_text(json.dumps(user_only) + "\n")
    first = load_image_prompts(data, tokenizer, processor, image_token="<|image_pad|>")
    assert first.ids == prompts.ids[:1] and first.references == prompts.references[:1]
    assert torch.equal(first.images[0].pixel_values, prompts.images[0].pixel_values)

    trajectory = Trajectory(group=0, token_ids=[1, 2], loss_mask=[0, 1], logprobs=[0.0, -0.5], versions=[-1, 0],
                            images=prompts.image(2))  # fmt: skip
    restored = Trajectory.from_state(json.loads(json.dumps(trajectory.to_state())))
    assert restored.images is not None and restored.images.num_images == 2
    assert torch.equal(restored.images.pixel_values, prompts.images[2].pixel_values)
    assert torch.equal(restored.images.image_grid_thw, prompts.images[2].image_grid_thw)


def test_grpo_trainer_runs_on_image_rows_and_exports_the_image_processor(vlm: dict[str, Any], tmp_path: Path) -> None:
    """`shardforge train grpo`'s config on a VLM: image prompts, one step with held-out evals, the trainer's
    log-probs equal the engine's (behaviour_kl), and the export loads with its image processor."""
    import json

    from transformers import AutoImageProcessor

    from shardforge.algorithms.config_io import apply_overrides, build_config
    from shardforge.algorithms.trainers.grpo import GRPOConfig, run_grpo

    data = {
        "model": vlm["model"], "train_file": str(vlm["train"]), "eval_file": str(vlm["eval"]),
        "output_dir": str(tmp_path), "layout": "d1", "steps": 1, "prompts_per_step": 2, "group_size": 2,
        "max_new_tokens": 4, "progress": False, "save_every": 0, "resume": "never",
        "reward_fn": "shardforge.algorithms.testing.vlm:colour_overlap_reward",
        "engine": {"max_tokens_per_microbatch": 256, "optimizer": {"lr": 3e-3}},
    }  # fmt: skip
    summary = run_grpo(build_config(GRPOConfig, apply_overrides(data, [])))
    train = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in train if r["split"] == "train")
    assert step["behaviour_kl"] < 1e-5 and step["reward_std"] > 0, step
    assert "accuracy_start" in summary and "accuracy_end" in summary
    processor = AutoImageProcessor.from_pretrained(summary["hf_dir"])
    assert processor.to_dict() == AutoImageProcessor.from_pretrained(vlm["model"]).to_dict()
