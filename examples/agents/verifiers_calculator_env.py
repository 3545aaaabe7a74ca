"""A verifiers 0.4 taskset over a prompt/completion JSONL (the calculator prompts of ``shardforge prepare-tiny``),
for ``workflow.name: verifiers`` (examples/grpo_verifiers_tiny.yaml). No shardforge import: a plain verifiers
taskset module, loaded by path (``workflow.verifiers.env: examples/agents/verifiers_calculator_env.py``), its
config field ``path`` set by ``workflow.verifiers.env_args``. Its reward is the rubric GRPO trains on."""

import json

import verifiers.v1 as vf


class CalculatorConfig(vf.TasksetConfig):
    path: str = "outputs/tiny_chat/data/train.jsonl"
    """Prompt/completion JSONL: each row is a task, its completion the answer."""


class CalculatorData(vf.TaskData):
    answer: str


class CalculatorTask(vf.Task[CalculatorData]):
    @vf.reward
    async def correct(self, task: CalculatorData, trace: vf.Trace) -> float:
        """1 when the reply ends with the answer."""
        return float((trace.last_reply or "").strip().endswith(task.answer))


class CalculatorTaskset(vf.Taskset[CalculatorTask, CalculatorConfig]):
    def load(self):
        with open(self.config.path) as rows:
            for line in rows:
                row = json.loads(line)
                yield CalculatorTask(CalculatorData(prompt=row["prompt"], answer=row["completion"]))


__all__ = ["CalculatorTaskset"]
