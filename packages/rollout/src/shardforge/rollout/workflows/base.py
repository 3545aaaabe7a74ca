"""The workflow protocol, its config and the WORKFLOWS registry.

A workflow runs one episode of an agent against a rollout engine and returns its trajectories:

    class MathAgent:
        def __init__(self, config: WorkflowConfig, tokenizer, reward_fn): ...
        async def run_episode(self, engine: EpisodeHandle, row: PromptRow) -> list[Trajectory]: ...

Built-ins are registered by name (``workflow.name: multi_turn``); a user's class is named by import
path (``workflow.name: my_pkg.agent:MathAgent``) and gets the same constructor arguments.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from shardforge.core.registry import Registry
from shardforge.rollout.episodes.request_queue import EpisodeHandle
from shardforge.rollout.episodes.trajectory import Trajectory
from shardforge.rollout.types import ImageInputs

if TYPE_CHECKING:
    from shardforge.rollout.types import PromptSet

__all__ = [
    "WORKFLOWS",
    "AgentConfig",
    "MultiTurnConfig",
    "OpenEnvConfig",
    "PromptRow",
    "ToolUseConfig",
    "VerifiersConfig",
    "Workflow",
    "WorkflowConfig",
    "WorkflowFactory",
    "build_workflow",
    "new_trajectory",
    "score",
    "score_in_batch",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class MultiTurnConfig:
    """The ``multi_turn`` workflow's own options (``workflow.multi_turn:``)."""

    turn_discount: float = 1.0
    """A correct answer at turn t (0-based) earns ``reward * turn_discount**t`` (AReaL's multi-turn)."""
    feedback: str = "Wrong, try again."
    """The user turn sent after a wrong answer."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.turn_discount <= 1.0:
            raise ValueError(f"workflow.multi_turn.turn_discount={self.turn_discount} must be in [0, 1]")


@dataclass(frozen=True, kw_only=True, slots=True)
class ToolUseConfig:
    """The ``tool_use`` workflow's own options (``workflow.tool_use:``)."""

    tools: tuple[str, ...] = ("calculator",)
    """Registered tools (calculator, python) or ``package.module:function`` (schema from its signature)."""
    timeout_s: float = 5.0
    """Per-call time limit; a call past it is killed and returned to the model as a timeout error."""

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise ValueError(f"workflow.tool_use.timeout_s={self.timeout_s} must be > 0")


@dataclass(frozen=True, kw_only=True, slots=True)
class AgentConfig:
    """The ``agent`` workflow's own options (``workflow.agent:``; docs/agents-openai.md)."""

    run: str = ""
    """``package.module:function``: ``async def run(client: openai.AsyncOpenAI, row: dict) -> float | None`` (row:
    prompt, reference, index; None: the run's reward function scores the last completion)."""
    command: tuple[str, ...] = ()
    """Instead of ``run``: an external program started once per episode (``[python, my_agent.py]``), any language,
    with ``OPENAI_BASE_URL`` and ``OPENAI_API_KEY`` (the episode's key) in its environment and the row as a JSON
    object on its stdin (also in ``SHARDFORGE_ROW``). The last line it prints is its reward (a number), or
    ``null`` / nothing for the run's reward function to score the last completion; a non-zero exit fails the
    episode."""
    timeout_s: float = 300.0
    """An episode whose agent runs longer fails (that episode only)."""
    model_name: str = "policy"
    """The model name the endpoint answers to (the agent's ``model=``)."""
    max_tokens: int = 4096
    """The largest ``max_tokens`` a request may ask (each request is also capped by the trainer's max_new_tokens)."""

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise ValueError(f"workflow.agent.timeout_s={self.timeout_s} must be > 0")
        if isinstance(self.command, str):
            raise ValueError(
                f"workflow.agent.command={self.command!r} must be a list of words, e.g. [python, agent.py]"
            )
        if self.run and self.command:
            raise ValueError("workflow.agent: set run (a Python function) or command (a program), not both")


@dataclass(frozen=True, kw_only=True, slots=True)
class VerifiersConfig:
    """The ``verifiers`` workflow's options (``workflow.verifiers:``; docs/agents-openai.md)."""

    env: str = ""
    """A verifiers 0.4 taskset / environment id (an importable module, e.g. an installed environment), or
    ``package.module:function`` / ``path/file.py:function`` returning a ``verifiers.v1.Env``."""
    env_args: dict[str, Any] = field(default_factory=dict)
    """An id: extra taskset config fields (``taskset.<key>``); a function: its keyword arguments."""
    max_concurrent: int = 64
    """Most episodes of this process the environment runs at once."""
    timeout_s: float = 300.0
    """An episode that runs longer fails (that episode only)."""
    model_name: str = "policy"
    """The model name the endpoint answers to."""
    max_tokens: int = 4096
    """The largest ``max_tokens`` a request may ask (each request is also capped by the trainer's max_new_tokens)."""

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise ValueError(f"workflow.verifiers.timeout_s={self.timeout_s} must be > 0")
        if self.max_concurrent < 1:
            raise ValueError(f"workflow.verifiers.max_concurrent={self.max_concurrent} must be >= 1")


@dataclass(frozen=True, kw_only=True, slots=True)
class OpenEnvConfig:
    """The ``openenv`` workflow's options (``workflow.openenv:``; docs/agents-openai.md)."""

    url: str = ""
    """A running OpenEnv environment server (``http://host:port``), or empty with ``app`` set."""
    app: str = ""
    """Instead of ``url``: the server's ASGI app, ``package.module:app`` or ``path/file.py:app`` (an OpenEnv
    ``create_app(...)``), served by uvicorn in local subprocesses this workflow starts, restarts and stops."""
    num_servers: int = 1
    """Local servers of ``app`` per process; the episodes of row ``g`` use server ``g % num_servers``."""
    action_field: str = "message"
    """The action sent each step: ``{action_field: the model's reply}``."""
    observation_field: str = "prompt"
    """The observation's text shown to the model as the user turn (reset: the first one; absent or empty at reset:
    the row's prompt)."""
    reset_args: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments of every reset (each reset also gets the row's ``prompt``, ``reference`` and the
    group's ``seed``; the server passes on those its environment's ``reset`` accepts)."""
    reward: str = "sum"
    """The episode's reward from the steps' rewards: ``sum`` or ``last``."""
    timeout_s: float = 300.0
    """An episode that runs longer fails (that episode only); also each message's wait on the server."""
    startup_timeout_s: float = 120.0
    """Most seconds a local server may take to answer ``/health``."""

    def __post_init__(self) -> None:
        if self.url and self.app:
            raise ValueError("workflow.openenv: set url (a running server) or app (served locally), not both")
        if self.app and ":" not in self.app:
            raise ValueError(f"workflow.openenv.app={self.app!r} must be 'package.module:app' or 'path/file.py:app'")
        if self.num_servers < 1:
            raise ValueError(f"workflow.openenv.num_servers={self.num_servers} must be >= 1")
        if self.reward not in ("sum", "last"):
            raise ValueError(f"workflow.openenv.reward={self.reward!r} must be 'sum' or 'last'")
        if self.timeout_s <= 0 or self.startup_timeout_s <= 0:
            raise ValueError("workflow.openenv.timeout_s and startup_timeout_s must be > 0")


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkflowConfig:
    """Which workflow turns data rows into trajectories, and its options (YAML ``workflow:``). A variant's own
    options are a section named after it (``multi_turn``, ``tool_use``)."""

    RENAMED_KEYS: ClassVar[dict[str, str]] = {
        "turn_discount": "multi_turn.turn_discount",
        "feedback": "multi_turn.feedback",
        "tools": "tool_use.tools",
        "tool_timeout_s": "tool_use.timeout_s",
    }

    name: str = "rlvr"
    """A registered workflow (rlvr, multi_turn, tool_use, agent, verifiers, openenv) or a user class ``package.module:Class``."""
    max_turns: int = 1
    """Most model turns per episode (multi_turn: answers; tool_use: tool calls + the final answer)."""
    max_total_tokens: int | None = None
    """Stop an episode before its sequence exceeds this many tokens (None: the trainer's micro-batch budget)."""
    chat_template: bool = False
    """Wrap the prompt text in the tokenizer's chat template (multi_turn / tool_use need one to add turns)."""
    system_prompt: str | None = None
    """Optional system message (chat_template=true only)."""
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    """The multi_turn workflow's options: turn_discount, feedback."""
    tool_use: ToolUseConfig = field(default_factory=ToolUseConfig)
    """The tool_use workflow's options: tools, timeout_s."""
    agent: AgentConfig = field(default_factory=AgentConfig)
    """The agent workflow's options: run (the agent function), timeout_s, model_name, max_tokens."""
    verifiers: VerifiersConfig = field(default_factory=VerifiersConfig)
    """The verifiers workflow's options: env (a verifiers environment), env_args, max_concurrent, timeout_s."""
    openenv: OpenEnvConfig = field(default_factory=OpenEnvConfig)
    """The openenv workflow's options: url or app (the environment server), action_field, observation_field, ..."""
    max_failed_fraction: float = 0.0
    """Fail the step when more than this fraction of the step's episodes crashed (a crash drops its whole group)."""
    options: dict[str, Any] = field(default_factory=dict)
    """Free-form options for a user workflow."""

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ValueError(f"workflow.max_turns={self.max_turns} must be >= 1")
        if not 0.0 <= self.max_failed_fraction <= 1.0:
            raise ValueError(f"workflow.max_failed_fraction={self.max_failed_fraction} must be in [0, 1]")


@dataclass(frozen=True, kw_only=True, slots=True)
class PromptRow:
    """One data row as a workflow sees it."""

    index: int
    """The row's index in this rank's batch (= the group of its trajectories)."""
    prompt: str
    """The prompt text."""
    reference: str
    """The reference answer the reward function checks."""
    prompt_ids: list[int]
    """The prompt tokenised without a chat template (what rlvr feeds the engine); an image prompt's ids are
    its chat rendered with the generation prompt, image tokens expanded (`rlvr.load_image_prompts`)."""
    images: ImageInputs | None = None
    """The prompt's images (a vision-language model's image prompt; None: text only). Every generate call
    of the row's episodes carries them, and so do its trajectories."""
    seed: int | None = None
    """Seed of this prompt's episodes (sample ``j``: ``seed + j``; see `rollout.seeds`), so they sample the same
    whichever rank runs them; None: derived from the call's ``SamplingParams.seed`` and ``index``."""

    @classmethod
    def from_prompts(cls, prompts: PromptSet, i: int, index: int, seed: int | None = None) -> PromptRow:
        """Prompt ``i`` of a loaded `rlvr.PromptSet` as the row at ``index`` of this rank's batch."""
        return cls(
            index=index,
            prompt=prompts.texts[i],
            reference=prompts.references[i],
            prompt_ids=prompts.ids[i],
            images=prompts.image(i),
            seed=seed,
        )


class Workflow(Protocol):
    """Runs one episode against a rollout engine; many run concurrently on one engine."""

    async def run_episode(self, engine: EpisodeHandle, row: PromptRow) -> list[Trajectory]:
        """The episode's trajectories (GRPO needs exactly one per episode)."""
        ...


class WorkflowFactory(Protocol):
    def __call__(self, config: WorkflowConfig, tokenizer: Any, reward_fn: Any) -> Workflow: ...


WORKFLOWS: Registry[WorkflowFactory] = Registry("workflow")
WORKFLOWS.register_lazy(
    "rlvr", "shardforge.rollout.workflows.rlvr:RLVRWorkflow", "One prompt -> one response -> verifier reward."
)
WORKFLOWS.register_lazy(
    "multi_turn",
    "shardforge.rollout.workflows.multi_turn:MultiTurnWorkflow",
    "Answer; on a wrong answer the verifier's feedback comes back as a user turn, up to max_turns.",
)
WORKFLOWS.register_lazy(
    "tool_use",
    "shardforge.rollout.workflows.tool_use:ToolUseWorkflow",
    "Qwen3-style <tool_call>{json}</tool_call> turns; tool results come back as tool messages.",
)


WORKFLOWS.register_lazy(
    "agent",
    "shardforge.rollout.workflows.agent:AgentWorkflow",
    "A user's agent written against the OpenAI client (workflow.agent.run), through an OpenAI-compatible endpoint.",
)

WORKFLOWS.register_lazy(
    "verifiers",
    "shardforge.rollout.workflows.verifiers_env:VerifiersWorkflow",
    "A verifiers 0.4 environment (workflow.verifiers.env) generating through the endpoint; its rubric scores.",
)

WORKFLOWS.register_lazy(
    "openenv",
    "shardforge.rollout.workflows.openenv_env:OpenEnvWorkflow",
    "An OpenEnv environment server (workflow.openenv) stepped with the policy's replies; its step rewards score.",
)


def build_workflow(config: WorkflowConfig, tokenizer: Any, reward_fn: Any) -> Workflow:
    """The workflow ``config.name`` names (a registered name or ``package.module:Class``)."""
    factory = WORKFLOWS.get(config.name)
    return factory(config, tokenizer, reward_fn)


def new_trajectory(row: PromptRow, prompt_ids: list[int]) -> Trajectory:
    """A trajectory holding just the (masked) prompt of ``row`` (and its images)."""
    trajectory = Trajectory(group=row.index, token_ids=[], loss_mask=[], logprobs=[], versions=[], images=row.images)
    trajectory.append(list(prompt_ids))
    return trajectory


def score(reward_fn: Any, row: PromptRow, response: str) -> float:
    """``reward_fn(prompt, response, reference)`` as a finite float; raises naming the prompt and response.
    Called here and now, alone: an episode on the trainers' `EpisodeHandle` should ``await score_in_batch(...)``."""
    try:
        value = float(reward_fn(row.prompt, response, row.reference))
    except Exception as exc:
        raise RuntimeError(
            f"the reward function raised on prompt {row.prompt!r}, response {response!r}: {exc!r}"
        ) from exc
    return _finite(value, row, response)


async def score_in_batch(engine: EpisodeHandle, reward_fn: Any, row: PromptRow, response: str) -> float:
    """`score`, but scored in one batch with the rewards every other live episode of the run asks for
    (`EpisodeHandle.score`): the batch goes to ``reward_fn`` at once (a `GuardedReward` scores it on its threads,
    ``reward.ray_workers`` over the Ray reward actors); a plain function is called item by item, in episode order.
    The same value, the same errors as `score`."""
    try:
        value = float(await engine.score(reward_fn, row.prompt, response, row.reference))
    except Exception as exc:
        raise RuntimeError(
            f"the reward function raised on prompt {row.prompt!r}, response {response!r}: {exc!r}"
        ) from exc
    return _finite(value, row, response)


def _finite(value: float, row: PromptRow, response: str) -> float:
    if not math.isfinite(value):
        raise ValueError(
            f"the reward function returned {value} for prompt {row.prompt!r}, response {response!r}; "
            "rewards must be finite numbers"
        )
    return value
