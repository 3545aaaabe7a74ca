"""What the RL trainers (GRPO, PPO) share: weight publishing to the rollout engine, held-out accuracy,
global reward statistics, the held-out split check."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from shardforge.algorithms.trainers.rl.colocate import check_colocation
from shardforge.algorithms.trainers.rl.dynamic_sampling import DynamicSamplingConfig
from shardforge.algorithms.trainers.rl.eval import EvalSamplingConfig
from shardforge.algorithms.trainers.rl.model_rewards import RewardModelConfig, RewardModelScorer
from shardforge.algorithms.trainers.run.common import build_reference, check_max_positions
from shardforge.algorithms.trainers.run.config import TrainerConfig
from shardforge.engine.objectives import PPOActorConfig
from shardforge.engine.objectives.kl_control import KLControlConfig
from shardforge.engine.objectives.rewards import RewardShapingConfig
from shardforge.engine.objectives.rollout_correction import ROLLOUT_CORRECTIONS, RolloutCorrectionConfig
from shardforge.rewards.compose import RewardTermConfig, build_reward
from shardforge.rewards.guarded import GuardedReward, RewardConfig
from shardforge.rewards.ray_pool import RayPooledReward, reward_actor_names_from_env
from shardforge.rollout.config import RolloutConfig
from shardforge.rollout.types import PromptSet
from shardforge.rollout.workflows import WorkflowConfig

if TYPE_CHECKING:  # the launching process imports this module for the config; only ranks build engines
    from shardforge.engine import TrainEngine

__all__ = [
    "RLTrainerConfig",
    "build_reference",
    "build_reward_fn",
    "build_reward_model",
    "check_eval_split",
    "check_image_prompts",
    "check_prompt_positions",
    "check_rollout_batch",
]


ROLLOUT_KEYS = {
    "rollout_engine": "rollout.engine",
    "rollout_dtype": "rollout.dtype",
    "rollout_placement": "rollout.placement",
    "num_rollout_actors": "rollout.num_actors",
    "rollout_on_actor_failure": "rollout.on_actor_failure",
    "rollout_sleep": "rollout.sleep",
    "publish_in_memory": "rollout.publish_in_memory",
    "rollout_kv_reuse": "rollout.kv_reuse",
    "rollout_kv_reuse_max_tokens": "rollout.kv_reuse_max_tokens",
    "partial_rollouts": "rollout.partial_rollouts",
    "interrupt_chunk_tokens": "rollout.interrupt_chunk_tokens",
    "vllm": "rollout.vllm",
}
"""The RL configs' flat rollout keys (until 2026-11) and the ``rollout:`` keys that replace them (config_io refuses
the old ones in one line naming the new)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RLTrainerConfig(TrainerConfig):
    """The fields every RL trainer (GRPO, PPO) shares: prompts, sampling, rewards, rollout engine, actor loss."""

    steps: int = 20
    """Optimizer steps / iterations (one rollout batch each)."""
    reads_data_sources: ClassVar[bool] = True
    RENAMED_KEYS: ClassVar[dict[str, str]] = ROLLOUT_KEYS
    prompts_per_step: int = 16
    """Prompts per step across all data-parallel ranks (a multiple of the dp size)."""
    group_size: int = 8
    """Samples per prompt."""
    max_new_tokens: int = 8
    """Generation budget per response."""
    max_prompt_len: int | None = None
    """Skip prompts longer than this many tokens (None = keep all; they must fit the budget)."""
    temperature: float = 1.0
    """Sampling temperature of the rollouts."""
    reward_fn: str = "exact_match"
    """'exact_match' or 'package.module:function' -> fn(prompt, response, reference) -> float."""
    rewards: tuple[RewardTermConfig, ...] = ()
    """A weighted sum of rewards, each ``{name, weight, args}`` (replaces reward_fn; see the catalogue)."""
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    """A trained reward model scoring every rollout in the loop (path, weight, offload); added to the rewards."""
    reference_model: str | None = None
    """Frozen reference policy for the KL terms (PPO's in-reward kl_coef, actor.kl_coef in the loss); None = model.
    Built only when a KL coefficient is > 0."""
    offload_reference: bool = False
    """Keep the reference policy's weights in host memory except during its forward (on an accelerator
    this frees its whole footprint for the actor; a no-op on CPU). PPO's critic equivalent is
    ``critic_engine.offload_when_idle``."""
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    """How the KL coefficient evolves (verl's algorithm.kl_ctrl: fixed | adaptive, target_kl, horizon): PPO's
    in-reward kl_coef, GRPO's in-loss actor.kl_coef (the configured coefficient is the start)."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """How reward functions run: timeout_s, max_concurrency, on_error (zero: a failed call scores 0.0, counted)."""
    reward_shaping: RewardShapingConfig = field(default_factory=RewardShapingConfig)
    """After scoring: DAPO overlong penalty (overlong_max_length, overlong_cache_length, overlong_factor), scale, clip."""

    actor: PPOActorConfig = field(default_factory=PPOActorConfig)
    """Actor PPO loss options (clip ranges, dual clip, aggregation, policy loss, ...)."""
    recompute_logprobs: bool = True
    """Recompute old log-probs with the trainer before the update (else use the rollout's)."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """The rollout engine and where it runs: engine (hf, vllm, a user's), dtype, placement (colocated |
    disaggregated), actors, sleep, in-memory publishing, KV reuse, partial rollouts, vllm options (the ``rollout:``
    section; `shardforge.rollout.RolloutConfig`)."""
    offload_train_state_during_rollout: bool = False
    """rollout.placement=colocated: the policy's (and PPO's critic's) weights and optimizer state go to host memory
    while the rollout engine generates and come back before the update (verl's param_offload / optimizer_offload,
    per phase). A no-op on CPU-only machines. Synchronous rollouts only. See docs/rl-placement.md."""
    eval_size: int | None = None
    """Evaluate on the first N held-out prompts (None = all)."""
    eval_sampling: EvalSamplingConfig = field(default_factory=EvalSamplingConfig)
    """Sampled held-out evaluation (samples, temperature, pass_k, ...): avg@n and pass@k next to greedy accuracy."""
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """Importance weights trainer/engine on every batch (mode, cap, band, batch_normalize); see the docs."""
    workflow: WorkflowConfig = field(default_factory=WorkflowConfig)
    """How a prompt becomes trajectories: rlvr (one response), multi_turn, tool_use or a user's workflow."""
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    """DAPO dynamic sampling: drop zero-variance groups (raw reward), backfill up to max_rounds rounds."""


def check_rollout_batch(config: RLTrainerConfig, prompts: PromptSet, dp_size: int, budget: int, where: str) -> None:
    """Refuse a rollout batch that cannot be split over ``dp_size`` ranks or does not fit the token
    ``budget`` (``where`` names the budget's setting and value in the message)."""
    if config.prompts_per_step < 1 or config.prompts_per_step % dp_size:
        raise ValueError(
            f"prompts_per_step={config.prompts_per_step} must be a positive multiple of the data-parallel size "
            f"{dp_size} (every rank samples whole groups)"
        )
    if config.group_size < 1:
        raise ValueError(f"group_size={config.group_size} must be >= 1")
    mode = config.rollout_correction.mode
    if not config.recompute_logprobs and ROLLOUT_CORRECTIONS.get(mode).recompute and mode != "none":
        raise ValueError(
            f"recompute_logprobs=false leaves no trainer log-probs for rollout_correction.mode={mode!r}; set "
            "rollout_correction.mode=bypass (the same as recompute_logprobs=false) or none, or keep recompute_logprobs=true"
        )
    collective = config.rollout.engine == "vllm" and config.rollout.vllm.weight_transport == "collective"
    if collective and getattr(config, "async_rollouts", False):
        raise ValueError(
            "async_rollouts loads older weight versions from disk while the trainer publishes newer ones; "
            "rollout.vllm.weight_transport=collective switches the server at every publish: set rollout.vllm.weight_transport=disk"
        )
    if config.engine.router_replay and config.rollout.engine != "hf":
        raise ValueError(
            f"engine.router_replay replays the routing the embedded HF engine records; rollout.engine="
            f"{config.rollout.engine!r} does not record it yet: use rollout.engine=hf or router_replay=false"
        )
    if config.rewards and config.reward_fn != "exact_match":
        raise ValueError(
            f"set reward_fn or rewards, not both (reward_fn={config.reward_fn!r}); add it to rewards as "
            f"{{name: {config.reward_fn}, weight: 1.0}}"
        )
    if config.reward_model.path is not None and config.dynamic_sampling.enabled:
        raise ValueError(
            "dynamic_sampling filters groups on the rewards while sampling, before the reward model scores them "
            "(collectively, in the training step): set dynamic_sampling.enabled=false or drop reward_model"
        )
    check_colocation(config)
    if prompts.images is not None:
        check_image_prompts(config)
    longest = max(len(p) for p in prompts.ids) + config.max_new_tokens
    if longest > budget:
        raise ValueError(
            f"the longest prompt + max_new_tokens is {longest} tokens but {where}; "
            "raise it or set max_prompt_len to skip long prompts"
        )


def check_image_prompts(config: RLTrainerConfig) -> None:
    """Refuse what image prompts (a vision-language model's) do not support yet, before any engine is built."""
    where = "image prompts (a vision-language model; docs/packages/algorithms-vlm.md)"
    if config.rollout.engine != "hf":
        raise ValueError(
            f"{where} are generated by the embedded HF engine only; rollout.engine={config.rollout.engine!r} does "
            "not take images yet: set rollout.engine=hf"
        )
    if config.rollout.partial_rollouts:
        raise ValueError(f"{where} do not support partial_rollouts yet: set rollout.partial_rollouts=false")
    if config.workflow.system_prompt is not None:
        raise ValueError(
            f"{where} are chats rendered as they are, so workflow.system_prompt would be ignored: put a system "
            "message in the rows' messages instead and unset workflow.system_prompt"
        )


def check_prompt_positions(config: RLTrainerConfig, prompts: PromptSet, hf_config: Any) -> None:
    """Prompt + max_new_tokens must fit the model's positions (a lower bound for multi-turn episodes)."""
    lengths = [len(ids) + config.max_new_tokens for ids in prompts.ids]
    fix = f"set max_prompt_len to skip long prompts or lower max_new_tokens={config.max_new_tokens}"
    check_max_positions(hf_config, lengths, "prompts (+ max_new_tokens)", fix)


def check_eval_split(config: Any, num_held_out: int | None, dp_size: int) -> None:
    """With one vLLM on rank 0 (``rollout.vllm.placement=rank0``) every data-parallel rank must join each
    ``generate``; a rank left without held-out prompts would skip it and the others would wait until
    the process-group timeout. Refuse that split before training starts."""
    if (
        num_held_out is None
        or dp_size <= 1
        or config.rollout.engine != "vllm"
        or config.rollout.vllm.placement != "rank0"
    ):
        return
    count = num_held_out if config.eval_size is None else min(config.eval_size, num_held_out)
    if count < dp_size:
        raise ValueError(
            f"held-out evaluation has {count} prompts for {dp_size} data-parallel ranks; with "
            f"rollout.vllm.placement=rank0 every rank needs at least one: raise eval_size (or the eval file) to >= {dp_size}, "
            "or use rollout.vllm.placement=each_rank"
        )


def build_reward_fn(config: RLTrainerConfig | Any) -> GuardedReward | RayPooledReward:
    """``config.rewards`` (a weighted sum) or ``config.reward_fn``, behind ``config.reward``'s timeout,
    concurrency limit and error policy; with ``reward.ray_workers`` on the Ray launcher's reward actors."""
    rewards = getattr(config, "rewards", ())
    fn = build_reward(config.reward_fn, rewards)
    name = getattr(fn, "__name__", config.reward_fn)
    if config.reward.ray_workers > 0:
        names = reward_actor_names_from_env(config.reward.ray_workers)  # refuses a rank not started by Ray
        return RayPooledReward(fn, config.reward, names, name=name)
    return GuardedReward(fn, config.reward, name=name)


def build_reward_model(config: RLTrainerConfig, policy: TrainEngine) -> RewardModelScorer | None:
    """The ``reward_model:`` scorer on the policy's layout (None when ``reward_model.path`` is unset)."""
    if config.reward_model.path is None:
        return None
    return RewardModelScorer(config.reward_model, config.layout, config.engine, policy.hf_config.vocab_size)
