"""An OpenEnv environment (openenv-core 0.3) over the calculator prompts of ``shardforge prepare-tiny``, for
``workflow.name: openenv`` (examples/grpo_openenv_tiny.yaml). No shardforge import: a plain OpenEnv server app that
shardforge serves with uvicorn in local subprocesses (``workflow.openenv.app: examples/agents/openenv_calculator_env.py:app``),
or that you run yourself (``uvicorn openenv_calculator_env:app --port 8000``; then ``workflow.openenv.url``).

Each reset gets the data row's ``prompt`` and ``reference`` (the answer); the model has two tries: a reply that ends
with the answer earns 1 and ends the episode, a wrong first reply is told to try again."""

from openenv.core.env_server import Environment, create_app
from openenv.core.env_server.types import Action, Observation, State

MAX_TRIES = 2


class ReplyAction(Action):
    message: str
    """The model's reply."""


class TextObservation(Observation):
    prompt: str = ""
    """What the model is told next."""


class CalculatorEnv(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True  # one instance per session: episodes run concurrently

    def __init__(self) -> None:
        super().__init__()
        self._state = State(step_count=0)
        self.answer = ""

    def reset(self, seed=None, episode_id=None, prompt: str = "", reference: str = "", **kwargs) -> TextObservation:
        self._state = State(episode_id=episode_id, step_count=0)
        self.answer = reference.strip()
        return TextObservation(prompt=prompt)

    def step(self, action: ReplyAction, timeout_s=None, **kwargs) -> TextObservation:
        self._state.step_count += 1
        correct = bool(self.answer) and action.message.strip().endswith(self.answer)
        done = correct or self._state.step_count >= MAX_TRIES
        return TextObservation(prompt="Wrong, try again.", done=done, reward=float(correct))

    @property
    def state(self) -> State:
        return self._state


app = create_app(CalculatorEnv, ReplyAction, TextObservation, env_name="calculator", max_concurrent_envs=256)
