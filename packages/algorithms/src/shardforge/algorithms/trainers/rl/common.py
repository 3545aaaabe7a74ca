"""What the RL trainers (GRPO, PPO) share: weight publishing to the rollout engine, held-out accuracy,
global reward statistics, the held-out split check."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist

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
from shardforge.mesh.collectives import all_reduce_max, all_reduce_sum, broadcast_floats
from shardforge.rewards.compose import RewardTermConfig, build_reward
from shardforge.rewards.guarded import GuardedReward, RewardConfig
from shardforge.rewards.ray_pool import RayPooledReward, reward_actor_names_from_env
from shardforge.rollout.factory import PublishedRolloutEngine, RolloutEngineKind
from shardforge.rollout.hf.engine import HFRolloutEngine
from shardforge.rollout.hf.kv_reuse import KVReuseCache
from shardforge.rollout.ray.placement import RolloutOnActorFailure, RolloutPlacement
from shardforge.rollout.types import PromptSet
from shardforge.rollout.vllm.engine import VLLMOptions
from shardforge.rollout.workflows import WorkflowConfig
from shardforge.weight_sync import DiskTransport

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
    "configure_kv_reuse",
    "dynamic_sampling_stats",
    "global_reward_stats",
    "publish_to_rollout",
    "publish_version",
    "record_routing",
    "reward_call_stats",
    "rollout_server_stats",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class RLTrainerConfig(TrainerConfig):
    """The fields every RL trainer (GRPO, PPO) shares: prompts, sampling, rewards, rollout engine, actor loss."""

    steps: int = 20
    """Optimizer steps / iterations (one rollout batch each)."""
    reads_data_sources: ClassVar[bool] = True
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
    publish_in_memory: bool = True
    """With the embedded HF rollout engine (synchronous), hand the new weights to every rank's engine in memory
    instead of a weight-sync version on disk (output_dir/weights); false: always through disk."""
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
    rollout_dtype: str = "float32"
    """Dtype of the rollout model and of the published weights."""
    rollout_engine: RolloutEngineKind = "hf"
    """'hf' (embedded generate in every trainer process) or 'vllm' (optional extra; see `vllm`)."""
    rollout_placement: RolloutPlacement = "colocated"
    """'colocated' (the rollout engine in every trainer process) or 'disaggregated' (--launcher ray; rollout_engine=hf:
    the embedded HF engine in num_rollout_actors Ray actors of their own, weights over weight-sync's collective
    transport after every step; rollout_engine=vllm with vllm.mode=server: one Ray actor running `vllm serve`,
    weights over the collective transport too, or as disk versions with vllm.weight_transport=disk). See
    docs/multinode.md."""
    num_rollout_actors: int = 1
    """rollout_placement=disaggregated: rollout actors (trainer rank r generates through actor r % num_rollout_actors;
    1 with rollout_engine=vllm)."""
    rollout_on_actor_failure: RolloutOnActorFailure = "error"
    """rollout_placement=disaggregated with rollout_engine=hf: a dead rollout actor ends the run with a one-line error
    ('error'), or is dropped: its ranks move to a surviving actor and generate their whole round again there ('drop',
    num_rollout_actors >= 2). A vLLM server actor is restarted instead (vllm.on_server_failure)."""
    rollout_sleep: bool = False
    """rollout_placement=colocated: the rollout engine frees its weights and KV caches after each batch's generation
    and gets them back with the next published version, so the training phase has the device memory (verl's
    free_cache_engine / vLLM sleep mode; vLLM: CUDA only). Synchronous rollouts only. See docs/rl-placement.md."""
    offload_train_state_during_rollout: bool = False
    """rollout_placement=colocated: the policy's (and PPO's critic's) weights and optimizer state go to host memory
    while the rollout engine generates and come back before the update (verl's param_offload / optimizer_offload,
    per phase). A no-op on CPU-only machines. Synchronous rollouts only. See docs/rl-placement.md."""
    rollout_kv_reuse: bool = True
    """rollout_engine=hf: keep each episode's KV cache between its turns (and between partial-rollout chunks) and
    prefill only the tokens a turn adds; dropped on every weight change. false: re-encode the context every turn."""
    rollout_kv_reuse_max_tokens: int = 65536
    """rollout_engine=hf: most tokens of KV cache kept over all live episodes (the oldest episodes' go first)."""
    vllm: VLLMOptions = field(default_factory=VLLMOptions)
    """vLLM rollout engine options (rollout_engine=vllm only)."""
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
    collective = config.rollout_engine == "vllm" and config.vllm.weight_transport == "collective"
    if collective and getattr(config, "async_rollouts", False):
        raise ValueError(
            "async_rollouts loads older weight versions from disk while the trainer publishes newer ones; "
            "vllm.weight_transport=collective switches the server at every publish: set vllm.weight_transport=disk"
        )
    if config.engine.router_replay and config.rollout_engine != "hf":
        raise ValueError(
            f"engine.router_replay replays the routing the embedded HF engine records; rollout_engine="
            f"{config.rollout_engine!r} does not record it yet: use rollout_engine=hf or router_replay=false"
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
    if config.rollout_engine != "hf":
        raise ValueError(
            f"{where} are generated by the embedded HF engine only; rollout_engine={config.rollout_engine!r} does "
            "not take images yet: set rollout_engine=hf"
        )
    if getattr(config, "partial_rollouts", False):
        raise ValueError(f"{where} do not support partial_rollouts yet: set partial_rollouts=false")
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


def publish_version(
    engine: TrainEngine,
    transport: DiskTransport | None,
    rollout: PublishedRolloutEngine,
    dtype: str,
    version: int | None = None,
) -> int:
    """Publish ``engine``'s weights as weight-sync version ``version`` (collective) and return it;
    when this returns, the version is committed on disk for every rank. ``version=None`` (a run's
    first publish) continues after any version already on disk, agreed from rank 0."""
    if version is None:
        latest = float(rollout.source.latest() or 0) if rollout.source else 0.0
        world = dist.group.WORLD if dist.is_initialized() else None
        version = int(broadcast_floats(latest, src=0, group=world, device=engine.device)[0]) + 1
    engine.publish_weights(transport, version, dtype=dtype)
    if dist.is_initialized():
        dist.barrier()
    return version


def publish_to_rollout(
    engine: TrainEngine,
    transport: DiskTransport | None,
    rollout: PublishedRolloutEngine,
    dtype: str,
    version: int | None = None,
) -> int:
    """Publish ``engine``'s weights as a new version and switch every rank's rollout engine to it;
    return the next version number (``version=None``: see `publish_version`)."""
    version = publish_version(engine, transport, rollout, dtype, version)
    rollout.update_weights(version)
    return version + 1


def check_eval_split(config: Any, num_held_out: int | None, dp_size: int) -> None:
    """With one vLLM on rank 0 (``vllm.placement=rank0``) every data-parallel rank must join each
    ``generate``; a rank left without held-out prompts would skip it and the others would wait until
    the process-group timeout. Refuse that split before training starts."""
    if num_held_out is None or dp_size <= 1 or config.rollout_engine != "vllm" or config.vllm.placement != "rank0":
        return
    count = num_held_out if config.eval_size is None else min(config.eval_size, num_held_out)
    if count < dp_size:
        raise ValueError(
            f"held-out evaluation has {count} prompts for {dp_size} data-parallel ranks; with "
            f"vllm.placement=rank0 every rank needs at least one: raise eval_size (or the eval file) to >= {dp_size}, "
            "or use vllm.placement=each_rank"
        )


def global_reward_stats(rewards: torch.Tensor, lengths: torch.Tensor, engine: TrainEngine) -> dict[str, float]:
    """Reward mean/std, positive fraction and mean response length over the data-parallel group."""
    rewards = rewards.double()
    count, total, squares, length, positive = all_reduce_sum(
        rewards.numel(), rewards.sum(), (rewards**2).sum(), lengths.sum(), (rewards > 0).sum(),
        group=engine.dp_group, device=engine.device,
    )  # fmt: skip
    mean = total / count
    return {
        "reward_mean": mean,
        "reward_std": math.sqrt(max(squares / count - mean * mean, 0.0)),
        "reward_positive_frac": positive / count,
        "response_len_mean": length / count,
    }


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


def record_routing(config: RLTrainerConfig, rollout: PublishedRolloutEngine) -> None:
    """With ``engine.router_replay``, make the (embedded HF) rollout engine record every token's experts."""
    if config.engine.router_replay:
        getattr(rollout, "record_routing")()  # noqa: B009  (HFRolloutEngine: check_rollout_batch made sure)


def configure_kv_reuse(config: RLTrainerConfig, rollout: PublishedRolloutEngine) -> None:
    """Apply ``rollout_kv_reuse`` / ``rollout_kv_reuse_max_tokens`` to the embedded HF engine (others: no-op)."""
    if isinstance(rollout, HFRolloutEngine):
        rollout.kv_reuse = config.rollout_kv_reuse
        rollout.kv_cache = KVReuseCache(config.rollout_kv_reuse_max_tokens)


def build_reward_model(config: RLTrainerConfig, policy: TrainEngine) -> RewardModelScorer | None:
    """The ``reward_model:`` scorer on the policy's layout (None when ``reward_model.path`` is unset)."""
    if config.reward_model.path is None:
        return None
    return RewardModelScorer(config.reward_model, config.layout, config.engine, policy.hf_config.vocab_size)


def reward_call_stats(reward_fn: GuardedReward | RayPooledReward, engine: TrainEngine) -> dict[str, float]:
    """``reward/calls|failures|timeouts|nonfinite`` since the last call, summed over the data-parallel group."""
    local = reward_fn.pop_stats()
    names = sorted(local)
    summed = dict(zip(names, all_reduce_sum(*(local[n] for n in names), group=engine.dp_group, device=engine.device),
                      strict=True))  # fmt: skip
    scored = summed.pop("reward/terms_scored", None)  # rewards: per-term sums -> per-term means
    if scored is None:
        return summed
    return {(k[: -len("_sum")] + "_mean" if k.endswith("_sum") else k): (v / max(scored, 1.0) if k.endswith("_sum") else v)
            for k, v in summed.items()}  # fmt: skip


def rollout_server_stats(rollout: object, engine: TrainEngine) -> dict[str, float]:
    """A rollout server's ``rollout_server/health_checks|failures|restarts|resent_requests`` since the
    last call, summed over the data-parallel group; empty for engines without a server (every rank
    has the same engine, so every rank returns the same keys)."""
    pop = getattr(rollout, "pop_stats", None)
    if not callable(pop):
        return {}
    local: dict[str, float] = pop()
    names = sorted(local)
    return dict(zip(names, all_reduce_sum(*(local[n] for n in names), group=engine.dp_group, device=engine.device),
                    strict=True))  # fmt: skip


def dynamic_sampling_stats(local: dict[str, float], engine: TrainEngine) -> dict[str, float]:
    """Dynamic sampling's per-rank counts summed over the data-parallel group (``rounds`` and
    ``cap_hit``: the maximum over ranks), as ``dynamic_sampling/*`` metrics."""
    names = sorted(local)
    summed = all_reduce_sum(*(local[n] for n in names), group=engine.dp_group, device=engine.device)
    maxed = all_reduce_max(local["rounds"], local["cap_hit"], group=engine.dp_group, device=engine.device)
    out = dict(zip(names, summed, strict=True)) | {"rounds": maxed[0], "cap_hit": maxed[1]}
    return {f"dynamic_sampling/{k}": v for k, v in out.items()}
