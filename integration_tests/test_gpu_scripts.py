"""The GPU suite and benchmark scripts stay runnable on a machine without CUDA (issue 23).

Each `benchmarks/gpu/bench_*.py` and `bash benchmarks/gpu/run.sh env` must exit 0 and say "no CUDA
device"; `pytest gpu_tests` must skip every test (none errors at import or collection). The scripts
run with ``CUDA_VISIBLE_DEVICES=""`` so the check means the same on a GPU machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "benchmarks" / "gpu").glob("bench_*.py"))


def _env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "CUDA_VISIBLE_DEVICES": "", "SHARDFORGE_GPU_OUT": str(tmp_path), "OMP_NUM_THREADS": "1",
            "PYTHON": sys.executable, "SHARDFORGE_GPU_TESTS_ON_CPU": "0"}  # fmt: skip


# Runs every bench script as __main__ in one interpreter (one `import torch` instead of one per script)
# and prints each one's exit code and output between markers.
_DRIVER = """
import contextlib, io, runpy, sys
sys.path.insert(0, sys.argv[1])
paths = sys.argv[2:]
for path in paths:
    sys.argv, buffer, code = [path], io.StringIO(), 0
    with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    print(f"<<<{path}|{code}>>>" + buffer.getvalue() + "<<<end>>>")
"""


def test_every_gpu_script_and_run_sh_skip_cleanly_without_cuda(tmp_path: Path) -> None:
    assert {p.name for p in SCRIPTS} >= {"bench_mfu.py", "bench_varlen.py", "bench_planner.py", "bench_publish.py"}
    env = _env(tmp_path)
    scripts = subprocess.Popen(
        [sys.executable, "-c", _DRIVER, str(ROOT / "benchmarks" / "gpu"), *map(str, SCRIPTS)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    run_sh = subprocess.Popen(
        ["bash", str(ROOT / "benchmarks" / "gpu" / "run.sh"), "env"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    out, _ = run_sh.communicate(timeout=120)
    assert run_sh.returncode == 0 and "no CUDA device" in out, f"run.sh env exited {run_sh.returncode}:\n{out}"
    out, _ = scripts.communicate(timeout=180)
    assert scripts.returncode == 0, out
    for path in SCRIPTS:
        head = f"<<<{path}|"
        assert head in out, f"{path.name} did not run:\n{out}"
        code, text = out.split(head, 1)[1].split("<<<end>>>", 1)[0].split(">>>", 1)
        assert code == "0", f"{path.name} exited {code}:\n{text}"
        assert "no CUDA device" in text, f"{path.name} did not say 'no CUDA device':\n{text}"
    assert not list(tmp_path.glob("*.json")), "a benchmark wrote results without a GPU"


def test_gpu_tests_all_skip_without_cuda(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "gpu_tests"],
        cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    summary = out.strip().splitlines()[-1]
    assert " skipped" in summary and "passed" not in summary and "error" not in summary, summary
    skips = [line for line in out.splitlines() if line.startswith("SKIPPED")]
    assert skips and all("no CUDA device" in line for line in skips), skips


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(pytest.main([__file__, "-q"]))
