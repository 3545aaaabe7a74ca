"""Hook points (`shardforge.core.hooks`): functions registered for a point run in order when it fires, with its
keyword arguments; `clear` forgets them; an unknown point is refused; modules named in ``SHARDFORGE_HOOKS`` are
imported once, at the first `fire` of a process (checked in fresh processes, where the module-level state of
`hooks` starts empty)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from shardforge.core import hooks


@pytest.fixture(autouse=True)
def _no_hooks(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv(hooks.HOOKS_ENV, raising=False)
    hooks.clear()
    yield
    hooks.clear()


def test_fire_runs_the_registered_functions_in_order_with_the_points_arguments() -> None:
    calls: list[tuple[str, dict[str, Any]]] = []
    hooks.register("step_end", lambda **kw: calls.append(("first", kw)))
    hooks.register("step_end", lambda **kw: calls.append(("second", kw)))
    hooks.register("step_start", lambda **kw: calls.append(("start", kw)))
    hooks.fire("step_end", step=3)
    assert calls == [("first", {"step": 3}), ("second", {"step": 3})]
    hooks.fire("rollout_generate", index=0, call=1)  # nothing registered there: nothing runs
    assert len(calls) == 2


def test_clear_one_point_or_every_point() -> None:
    calls: list[str] = []
    hooks.register("step_start", lambda **kw: calls.append("start"))
    hooks.register("step_end", lambda **kw: calls.append("end"))
    hooks.clear("step_start")
    hooks.fire("step_start", step=1)
    hooks.fire("step_end", step=1)
    assert calls == ["end"]
    hooks.clear()
    hooks.fire("step_end", step=2)
    assert calls == ["end"]


def test_an_exception_in_a_hook_reaches_the_code_that_fired_it() -> None:
    def boom(**kwargs: Any) -> None:
        raise RuntimeError(f"injected at {kwargs}")

    hooks.register("step_end", boom)
    with pytest.raises(RuntimeError, match=r"injected at \{'step': 5\}"):
        hooks.fire("step_end", step=5)


def test_an_unknown_point_is_refused_with_the_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown hook point 'step_ned'; valid: \['step_start', 'step_end'"):
        hooks.register("step_ned", lambda **kw: None)
    with pytest.raises(ValueError, match=r"unknown hook point 'step_ned'"):
        hooks.fire("step_ned", step=1)  # a misspelt fire would otherwise never run anything
    assert set(hooks.POINTS) == {"step_start", "step_end", "rollout_generate", "checkpoint_write"}


def _run(code: str, env_hooks: str | None, path: Path, **extra_env: str) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter with ``SHARDFORGE_HOOKS=env_hooks`` (unset when None), ``path`` importable."""
    env = {**os.environ, **extra_env}
    env.pop(hooks.HOOKS_ENV, None)
    if env_hooks is not None:
        env[hooks.HOOKS_ENV] = env_hooks
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(path), env.get("PYTHONPATH", "")) if p)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True, timeout=120
    )


def test_modules_named_in_the_environment_are_imported_once_at_the_first_fire(tmp_path: Path) -> None:
    (tmp_path / "my_test_hooks.py").write_text(
        textwrap.dedent(
            """
            import os

            from shardforge.core import hooks

            def log(line):
                with open(os.environ["HOOK_LOG"], "a") as f:
                    print(line, file=f)

            log("imported")
            hooks.register("step_end", lambda step: log(f"step_end {step}"))
            """
        )
    )
    code = """
        import json, sys
        from shardforge.core import hooks

        before = "my_test_hooks" in sys.modules
        hooks.fire("step_start", step=1)  # the first fire of the process imports the modules, whatever the point
        after = "my_test_hooks" in sys.modules
        hooks.fire("step_end", step=1)
        hooks.fire("step_end", step=2)
        print(json.dumps({"before": before, "after": after, "torch": "torch" in sys.modules}))
    """
    log = tmp_path / "hooks.log"
    out = _run(code, " my_test_hooks, ,", tmp_path, HOOK_LOG=str(log))  # spaces and empty names are ignored
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1]) == {"before": False, "after": True, "torch": False}
    assert log.read_text().splitlines() == ["imported", "step_end 1", "step_end 2"]


def test_without_the_variable_fire_imports_nothing(tmp_path: Path) -> None:
    code = """
        import json, sys
        from shardforge.core import hooks

        loaded = set(sys.modules)
        hooks.fire("step_end", step=1)
        print(json.dumps(sorted(set(sys.modules) - loaded)))
    """
    out = _run(code, None, tmp_path)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1]) == []


def test_a_module_that_cannot_be_imported_names_the_variable_and_the_module(tmp_path: Path) -> None:
    code = """
        from shardforge.core import hooks
        hooks.fire("step_end", step=1)
    """
    out = _run(code, "no_such_hook_module_xyz", tmp_path)
    assert out.returncode != 0
    assert "ImportError: SHARDFORGE_HOOKS='no_such_hook_module_xyz': cannot import hook module" in out.stderr
    assert "'no_such_hook_module_xyz'" in out.stderr
