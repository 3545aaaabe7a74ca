"""shardforge.algorithms: trainers (SFT, reward model, DPO, PPO, GRPO family, distillation, evaluation), their
data, loggers, the planner, launchers and the ``shardforge`` command.

It composes the packages below it: the training engine (`shardforge.engine`), the rollout engines and
workflows (`shardforge.rollout`) and the reward functions (`shardforge.rewards`). Importing this package
imports none of them (the launching ``shardforge`` process reads configs without the engine's imports).
"""

__version__ = "0.1.0"

__all__: list[str] = []
