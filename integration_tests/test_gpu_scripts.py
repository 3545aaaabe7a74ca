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


def test_every_gpu_script_and_run_sh_skip_cleanly_without_cuda(tmp_path: Path) -> None:
    assert {p.name for p in SCRIPTS} >= {"bench_mfu.py", "bench_varlen.py", "bench_planner.py", "bench_publish.py"}
    commands = {p.name: [sys.executable, str(p)] for p in SCRIPTS}
    commands["run.sh env"] = ["bash", str(ROOT / "benchmarks" / "gpu" / "run.sh"), "env"]
    # In parallel: each start-up is mostly `import torch`.
    procs = {
        name: subprocess.Popen(
            cmd, cwd=ROOT, env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for name, cmd in commands.items()
    }
    for name, proc in procs.items():
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, f"{name} exited {proc.returncode}:\n{out}"
        assert "no CUDA device" in out, f"{name} did not say 'no CUDA device':\n{out}"
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
