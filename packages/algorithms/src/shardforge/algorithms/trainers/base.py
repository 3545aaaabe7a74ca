"""THE run loop of every trainer (the config fields they share: `trainers.run.config.TrainerConfig`).

`Trainer.run` does, in this order and once for all trainers: tokenizer, data (`load_data`),
engines (`build_engines`), output dir + resolved ``config.json``, checkpointers (with
``async_checkpoint``), resume (+ the data-order check and the metrics truncation), `setup`,
optional eval at the start, then per step `train_step` -> log cadence -> save cadence -> eval
cadence, and at the end HF + LoRA export (+ `export_extra`), ``summary.json`` and a barrier.

A trainer subclasses `TrainerConfig` (only its own fields; YAML keys are the field names) and
`Trainer` (only its hooks). A fix to the loop reaches every trainer (STYLE.md item 17).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import torch.distributed as dist

from shardforge.algorithms.config_io import config_to_dict
from shardforge.algorithms.loggers import MetricsLogger, truncate_metrics, write_curves
from shardforge.algorithms.trainers.run.common import progress_bar
from shardforge.algorithms.trainers.run.config import TrainerConfig, load_tokenizer
from shardforge.algorithms.trainers.run.profiling import StepProfiler, take_phase_seconds
from shardforge.algorithms.trainers.run.resume_check import check_resume_config
from shardforge.algorithms.trainers.run.startup_gc import end_startup_gc
from shardforge.algorithms.trainers.run.stop import StopSignal
from shardforge.algorithms.trainers.run.watchdog import StepWatchdog, collective_timeout_error, is_collective_timeout
from shardforge.core import hooks
from shardforge.core.log import rank_log_file

if TYPE_CHECKING:  # the launching process imports this module for the config: no engine, no DCP there
    from shardforge.checkpoint_dcp import Checkpointer
    from shardforge.engine import TrainEngine

__all__ = ["Trainer", "check_data_state"]

logger = logging.getLogger(__name__)


C = TypeVar("C", bound=TrainerConfig)


def _previous_config(config_json: Path) -> dict[str, Any] | None:
    """The resolved config of the run that last wrote ``config_json`` (None if there is none)."""
    try:
        previous = json.loads(config_json.read_text())
    except (OSError, ValueError):
        return None
    return previous if isinstance(previous, dict) else None


def check_data_state(saved: dict[str, Any], current: dict[str, Any]) -> None:
    """Refuse to resume when a setting that decides the data order differs from the checkpoint's."""
    changed = {k: (saved.get(k), v) for k, v in current.items() if saved.get(k) != v}
    if changed:
        details = ", ".join(f"{k}: checkpoint {a!r} vs config {b!r}" for k, (a, b) in changed.items())
        raise ValueError(
            f"cannot resume: the data order differs from the checkpoint ({details}); restore those settings "
            "or start a fresh run (resume=never or a new output_dir)"
        )


class Trainer(Generic[C]):
    """One run of a trainer: subclasses implement the hooks, `run` is shared."""

    name = "train"
    """Progress-bar label and error-message prefix."""

    def __init__(self, config: C) -> None:
        self.config = config
        self.out = Path(config.output_dir)
        self.tokenizer: Any = None
        self.engine: TrainEngine

    # ------------------------------------------------------------------ hooks
    def load_data(self) -> None:
        """Read and check the data (before any engine, so data errors come before process groups)."""

    def build_engines(self) -> TrainEngine:
        """Build and return the engine that trains (others, e.g. a critic, live on ``self``)."""
        raise NotImplementedError

    def data_state(self) -> dict[str, Any]:
        """The settings that decide the data order; a resume with different ones is refused."""
        raise NotImplementedError

    def checkpoint_engines(self) -> dict[str, TrainEngine]:
        """Checkpoint subdirectory -> engine; the first decides the resume step."""
        return {"checkpoints": self.engine}

    def start_step(self) -> int:
        """The loop step to resume at, from the loaded main engine (optimizer steps by default)."""
        return self.engine.step

    def setup(self, start: int, restored: dict[str, Any]) -> None:
        """After resume, before the first step (``restored``: the checkpoint's extra state, or {})."""

    def train_step(self, step: int) -> dict[str, float]:
        """One step (0-based); return its metrics (at least ``loss``)."""
        raise NotImplementedError

    def has_eval(self) -> bool:
        return self.config.eval_file is not None or self.config.data.eval is not None

    eval_at_start = False
    """Also evaluate before the first step."""

    def evaluate(self) -> dict[str, float]:
        """Held-out metrics (collective)."""
        raise NotImplementedError

    def eval_summary(self, result: dict[str, float], at_start: bool) -> dict[str, Any]:
        """Summary entries for an eval result."""
        return {f"eval_{k}": v for k, v in result.items() if k in ("loss", "accuracy")}

    def step_summary(self, stats: dict[str, float]) -> dict[str, Any]:
        """Summary entries for a step's metrics (the last step's remain)."""
        return {"train_loss": stats["loss"]}

    def postfix(self, stats: dict[str, float]) -> dict[str, str]:
        """Progress-bar fields for a step's metrics."""
        return {"loss": f"{stats['loss']:.4f}"}

    def extra_state(self) -> dict[str, Any]:
        """Extra state saved with the checkpoint (collective if it gathers)."""
        return {}

    def export_extra(self, summary: dict[str, Any]) -> None:
        """Extra exports at the end (export_hf_at_end), recorded in ``summary``."""

    def close(self) -> None:
        """Release what `setup` made (also after an error)."""

    # ------------------------------------------------------------------ the loop
    def run(self) -> dict[str, Any]:
        """Train; return the summary (also written to output_dir/summary.json). Call on every rank.

        Every rank's log messages also go to output_dir/logs/rank{R}.log (the console shows rank 0)."""
        with rank_log_file(self.out / "logs"):
            return self._run()

    def _run(self) -> dict[str, Any]:
        config, out = self.config, self.out
        self.tokenizer = load_tokenizer(config)
        self.load_data()
        engine = self.engine = self.build_engines()
        logger.info(
            "rank %d of %d: layout %s on %s",
            dist.get_rank() if dist.is_initialized() else 0,
            dist.get_world_size() if dist.is_initialized() else 1,
            engine.dims.to_string(),
            engine.device,
        )
        # Every rank reads the previous run's config before rank 0 replaces it: when a checkpoint exists, its
        # collective load in _resume comes between the two.
        previous = _previous_config(out / "config.json")
        # The engine's config as built (e.g. scheduler.total_steps resolved from steps).
        resolved = config_to_dict(dataclasses.replace(config, engine=engine.config))  # type: ignore[type-var]
        if engine.is_main:
            out.mkdir(parents=True, exist_ok=True)
        data_state = self.data_state()
        checkpointers: dict[str, Checkpointer] = {}
        # resume=auto alone opens checkpointers only when a checkpoint directory exists (no empty dirs).
        first_dir = out / next(iter(self.checkpoint_engines()))
        if config.save_every > 0 or (config.resume != "never" and first_dir.is_dir()):
            checkpointers = self._checkpointers()
        start, restored = self._resume(checkpointers, data_state)
        previous_steps = (previous or {}).get("steps")
        if start:
            where = str(out / next(iter(self.checkpoint_engines())))
            for note in check_resume_config(previous, resolved, mode=config.resume, checkpoint=where, step=start):
                if engine.is_main:
                    logger.warning("%s", note)
        if engine.is_main:
            (out / "config.json").write_text(json.dumps(resolved, indent=2))
        if start and previous_steps not in (None, config.steps) and engine.is_main:
            logger.warning(
                "steps changed from %s (the previous run) to %d: training continues from step %d%s",
                previous_steps,
                config.steps,
                start,
                f" to {config.steps}" if start < config.steps else " but there is nothing left to train (export only)",
            )
        logged_until = truncate_metrics(out / "metrics.jsonl", start) if engine.is_main else None
        metrics = MetricsLogger(
            out,
            enabled=engine.is_main,
            names=config.loggers,
            run_config=config_to_dict(config) if engine.is_main else {},
        )
        metrics.begin(
            start,
            {"layout": engine.dims.to_string(), "world_size": dist.get_world_size() if dist.is_initialized() else 1},
            logged_until=logged_until,
        )
        summary: dict[str, Any] = {"steps": config.steps, "output_dir": str(out), "layout": engine.dims.to_string()}
        if start:
            summary["resumed_from"] = start
        bar = None
        rank = dist.get_rank() if dist.is_initialized() else 0
        timeout_s = engine.config.dist_timeout_s
        dump_s = 0.9 * timeout_s if config.hang_dump_s is None else config.hang_dump_s
        watchdog = StepWatchdog(out / "logs", rank, dump_s if dist.is_initialized() else 0.0)  # trainers/watchdog.py
        stop = StopSignal(
            watchdog.teardown_reason
        )  # SIGTERM/SIGINT: finish the step, save, leave the loop (trainers/stop.py)
        profiler = StepProfiler(config.profile, out, rank)
        try:
            self.setup(start, restored)
            end_startup_gc()  # start-up made its long-lived objects: freeze them, collect again (startup_gc.py)
            if self.eval_at_start and self.has_eval():
                result = self.evaluate()
                metrics.log(start, result, split="eval")
                summary |= self.eval_summary(result, at_start=True)
                self._log_eval(start, result)
            bar = progress_bar(config.steps, start, engine.is_main and config.progress, self.name)
            stop.__enter__()
            for step in range(start, config.steps):
                watchdog.arm(step + 1)
                hooks.fire("step_start", step=step + 1)  # tests hang a rank here (testing/fault_injection.py)
                profiler.before_step(step + 1)
                take_phase_seconds()  # drop what ran between steps (eval, setup)
                step_start = time.perf_counter()
                stats = self.train_step(step)
                stats |= _timings(take_phase_seconds(), time.perf_counter() - step_start)
                profiler.after_step(step + 1)
                if not math.isfinite(stats["loss"]):
                    raise FloatingPointError(
                        f"{self.name.upper()} loss became {stats['loss']} at step {step + 1}; lower the learning rate"
                    )
                last = step + 1 == config.steps
                if (step + 1) % config.log_every == 0 or last:
                    metrics.log(step + 1, stats)
                summary |= self.step_summary(stats)
                if bar is not None:
                    bar.set_postfix(**self.postfix(stats))
                    bar.update(1)
                signum = stop.requested(engine.device)
                due = config.save_every > 0 and ((step + 1) % config.save_every == 0 or last)
                if (checkpointers and due) or signum:
                    checkpointers = checkpointers or self._checkpointers()
                    state = data_state | self.extra_state()
                    for name, target in self.checkpoint_engines().items():
                        target.save(checkpointers[name], state)
                hooks.fire("step_end", step=step + 1)  # tests kill a rank here (testing/fault_injection.py)
                if signum:  # every rank saw it at this step (all-reduced): stop here, resumable
                    summary |= {"stopped_by": StopSignal.name(signum), "stopped_at_step": step + 1}
                    logger.warning(
                        "%s: stopped after step %d, checkpoint saved to %s; rerun the same command to resume",
                        StopSignal.name(signum),
                        step + 1,
                        checkpointers[next(iter(checkpointers))].path(step + 1),
                    )
                    break
                if self.has_eval() and ((config.eval_every and (step + 1) % config.eval_every == 0) or last):
                    watchdog.arm(step + 1, "eval")
                    result = self.evaluate()
                    metrics.log(step + 1, result, split="eval")
                    summary |= self.eval_summary(result, at_start=False)
                    self._log_eval(step + 1, result)
            watchdog.disarm()
        except BaseException as exc:
            metrics.close()  # trackers' runs end (as finished) with the error; the finish below is skipped
            if is_collective_timeout(exc) and watchdog.after_s > 0:
                raise collective_timeout_error(exc, watchdog, timeout_s) from exc
            raise
        finally:
            watchdog.close()
            stop.__exit__()
            profiler.close()
            self.close()
            if bar is not None:
                bar.close()
        try:
            for checkpointer in checkpointers.values():
                checkpointer.close()
            if config.export_hf_at_end and "stopped_by" not in summary:
                self._export(summary)
            if engine.is_main:
                curves = write_curves(out / "metrics.jsonl", out / "curves.png", f"{self.name} {out.name}")
                if curves is not None:
                    summary["curves"] = str(curves)
                (out / "summary.json").write_text(json.dumps(summary, indent=2))
                artifacts = {name: out / name for name in ("hf", "lora", "summary.json", "curves.png")}
                metrics.finish(summary, artifacts)  # final metrics + HF export as tracker artifacts
        finally:
            metrics.close()
        if dist.is_initialized():
            dist.barrier()
        return summary

    def _log_eval(self, step: int, result: dict[str, float]) -> None:
        """The eval metrics in the terminal (main rank; the progress bar shows the training ones)."""
        if self.engine.is_main:
            shown = ", ".join(f"{k} {v:.4g}" for k, v in result.items() if isinstance(v, (int, float)))
            logger.info("step %d eval: %s", step, shown)

    def _checkpointers(self) -> dict[str, Checkpointer]:
        from shardforge.checkpoint_dcp import Checkpointer

        config = self.config
        return {
            name: Checkpointer(self.out / name, keep_last=config.keep_last, async_mode=config.async_checkpoint)
            for name in self.checkpoint_engines()
        }

    def _resume(self, checkpointers: dict[str, Checkpointer], data_state: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        if not checkpointers or self.config.resume == "never":
            return 0, {}
        (first, main), *others = self.checkpoint_engines().items()
        if self.config.resume == "latest_valid":  # the same decision on every rank: the files are shared
            valid = checkpointers[first].latest_valid_step()
            if valid is None:
                return 0, {}
            saved = main.load(checkpointers[first], step=valid)
        else:
            saved = main.load(checkpointers[first])
        if saved is None:
            return 0, {}
        check_data_state(saved, data_state)
        for name, engine in others:
            if engine.load(checkpointers[name], step=main.step) is None:
                raise FileNotFoundError(f"{first} at step {main.step} has no matching checkpoint in {name}")
        start = self.start_step()
        if main.is_main:
            logger.info("resumed from %s at step %d", checkpointers[first].path(main.step), start)
        return start, saved

    def _export(self, summary: dict[str, Any]) -> None:
        hf_dir = self.out / "hf"
        self.engine.export_hf(hf_dir, tokenizer=self.tokenizer)
        summary["hf_dir"] = str(hf_dir)
        if self.engine.config.lora is not None:  # also the adapters alone, in PEFT format
            self.engine.export_lora(self.out / "lora", base_model_name_or_path=self.config.model)
            summary["lora_dir"] = str(self.out / "lora")
        self.export_extra(summary)


def _timings(phases: dict[str, float], step_s: float) -> dict[str, float]:
    """``timing_s/<phase>`` and ``timing_s/step``: this rank's wall seconds (rank 0's are logged)."""
    return {f"timing_s/{name}": round(seconds, 4) for name, seconds in sorted(phases.items())} | {
        "timing_s/step": round(step_s, 4)
    }
