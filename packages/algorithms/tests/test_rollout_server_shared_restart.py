"""Restarts of a rollout server shared by several trainer ranks (`shardforge.rollout.server.shared_restart`).

Two gloo ranks share one stub server (tests/rollout_server_stub.py) that rank 0 started. The server dies with
one rank's batch in flight while the other rank's round already succeeded: the ranks must agree at the end of
the round, rank 0 must restart the server once at the current weight version, the failing rank must regenerate
its round (the same rollouts as a server that never died), and when ``max_server_restarts`` is used up every
rank must end with the same one-line error (none waits forever).
"""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from shardforge.rollout.testing import STUB_SERVER

STUB = STUB_SERVER
FAST = {"health_timeout_s": 0.5, "request_timeout_s": 2.0, "server_startup_timeout_s": 30.0}
PROMPTS = {0: [[5, 6, 7], [8, 9], [10]], 1: [[11, 12], [13], [14, 15, 16]]}
"""Each rank's own prompts (3 requests per rank and round)."""


def _wait_for(path: Path, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout_s} s")
        time.sleep(0.02)


def _two_ranks_share_a_server(tmp: Path, dying_rank: int) -> dict[str, Any]:
    """On each of 2 ranks: a no-death round at weight version 3, a round during which the server dies with
    ``dying_rank``'s batch in flight (the other rank's round has already succeeded), a switch to weight version 4
    that finds the server dead (killed between steps) and the round after it, then, with the two restarts used
    up, a round in which only the other rank sends requests to a killed server."""
    import torch.distributed as dist

    from shardforge.rollout.config import VLLMOptions
    from shardforge.rollout.server.health import RolloutServerError
    from shardforge.rollout.server.shared_restart import generation_round
    from shardforge.rollout.types import SamplingParams
    from shardforge.rollout.vllm.server import VLLMServerRolloutEngine

    marker = tmp / "die"

    class StubEngine(VLLMServerRolloutEngine):
        def _server_command(self, model_dir: Any, tokenizer: Any, dtype: str, seed: int, port: int) -> list[str]:
            return [sys.executable, str(STUB), "--port", str(port), "--die-once", str(marker)]

    rank = dist.get_rank()
    tokenizer = SimpleNamespace(eos_token_id=2, decode=lambda ids, skip_special_tokens=True: " ".join(map(str, ids)))
    params = SamplingParams(n=3, max_new_tokens=4, seed=7)
    options = VLLMOptions(mode="server", on_server_failure="restart", max_server_restarts=2, **FAST)
    engine = StubEngine(tmp, tokenizer, weights_root=tmp / "w", options=options, log_file=tmp / "log")

    def responses() -> list[tuple[int, list[int]]]:
        return [(r.prompt_index, r.response_ids) for r in engine.generate(PROMPTS[rank], params)]

    def state() -> dict[str, Any]:
        with urllib.request.urlopen(engine.url + "/stub/state", timeout=5) as reply:
            return json.loads(reply.read())  # type: ignore[no-any-return]

    attempts = 0

    def dying_round() -> list[tuple[int, list[int]]]:
        nonlocal attempts
        attempts += 1
        if rank != dying_rank:
            out = responses()
            (tmp / "other_done").touch()  # the survivor's round is over before the server dies
            return out
        if attempts == 1:
            _wait_for(tmp / "other_done")
            marker.touch()  # the server dies on this batch's first request (the next start finds no marker)
        return responses()

    try:
        engine.update_weights(3)
        expected = generation_round(engine, responses)
        first_pid = state()["pid"]
        engine.pop_stats()
        got = generation_round(engine, dying_round)
        after = state()
        stats = engine.pop_stats()
        restarts = engine.health.total_restarts

        def kill() -> None:
            dist.barrier()  # every rank is between rounds
            if rank == 0 and engine.process is not None:
                engine.process.kill()
                engine.process.wait()
            dist.barrier()

        # The server dies between steps: rank 0's switch to version 4 fails, the next round restarts it at 4.
        kill()
        engine.update_weights(4)
        after_switch = generation_round(engine, responses)
        switch_state, switch_stats = state(), engine.pop_stats()
        healthy4 = generation_round(engine, responses)

        # max_server_restarts=2 is used up: only the other rank sends requests, to a killed server.
        kill()
        error = None
        try:
            generation_round(engine, responses if rank != dying_rank else list)
        except RolloutServerError as exc:
            error = str(exc)
        return {
            "expected": expected, "got": got, "attempts": attempts, "first_pid": first_pid, "state": after,
            "stats": stats, "restarts": restarts, "error": error, "url": engine.url, "after_switch": after_switch,
            "healthy4": healthy4, "switch_state": switch_state, "switch_stats": switch_stats,
            "total_restarts": engine.health.total_restarts,
        }  # fmt: skip
    finally:
        engine.shutdown(grace_s=5.0)


@pytest.mark.parametrize("dying_rank", [1, 0])
def test_two_ranks_restart_their_shared_server_at_the_current_version(tmp_path: Path, dying_rank: int) -> None:
    from shardforge.mesh.testing import get_rank_pool

    results = get_rank_pool(2).run(_two_ranks_share_a_server, tmp_path, dying_rank, timeout_s=90)
    other = 1 - dying_rank
    starts = [line for line in (tmp_path / "log").read_text().splitlines() if line.startswith("stub server ")]
    assert len(starts) == 3, f"the server was started once and restarted twice: {starts}"
    for rank, out in enumerate(results):
        assert out["got"] == out["expected"], f"rank {rank}: the rollouts differ from a healthy server's"
    for rank, out in enumerate(results):
        assert out["state"]["version"] == 3, "the restarted server serves the current weight version"
        assert out["state"]["pid"] != out["first_pid"]
        assert out["restarts"] == 1, f"rank {rank}: the run's restart count (max_server_restarts) is the same"
    assert results[dying_rank]["attempts"] == 2 and results[other]["attempts"] == 1  # only the lost round reruns
    # Summed over ranks (as the trainer logs them): one restart, one failure, the lost round's 3 requests resent.
    total = {k: sum(out["stats"][k] for out in results) for k in results[0]["stats"]}
    assert total == {"rollout_server/health_checks": 3.0, "rollout_server/failures": 1.0,
                     "rollout_server/restarts": 1.0, "rollout_server/resent_requests": 3.0}  # fmt: skip
    assert results[0]["stats"]["rollout_server/restarts"] == 1.0  # reported by the owner only

    # Dead at the switch to version 4: stopped, restarted at version 4 by the next round (both ranks regenerate).
    for rank, out in enumerate(results):
        assert out["switch_state"]["version"] == 4 and out["after_switch"] == out["healthy4"], rank
        assert out["after_switch"] != out["expected"] and out["total_restarts"] == 2, rank
    total = {k: sum(out["switch_stats"][k] for out in results) for k in results[0]["switch_stats"]}
    assert total == {"rollout_server/health_checks": 4.0, "rollout_server/failures": 2.0,
                     "rollout_server/restarts": 1.0, "rollout_server/resent_requests": 6.0}  # fmt: skip

    # Restarts used up: every rank ends with the same one-line error (also the rank that sent nothing).
    url = results[0]["url"]
    errors = [out["error"] for out in results]
    assert errors[0] is not None and errors[0] == errors[1], errors
    assert "\n" not in errors[0]
    assert errors[0].startswith(f"rollout server {url} is down: /health: connection refused")
    assert f"(seen by rank(s) [{other}])" in errors[0]
    assert (
        f"check its log {tmp_path / 'log'}" in errors[0] and "rollout.vllm.max_server_restarts is used up" in errors[0]
    )


def _share_a_server_given_by_url(url: str, pid: int, tmp: Path) -> str | None:
    """Rank 0 kills the server given by URL (its process ``pid``), rank 1 sends requests to it, rank 0 sends
    nothing; the error each rank ends with."""
    import os
    import signal

    import torch.distributed as dist

    from shardforge.rollout.config import VLLMOptions
    from shardforge.rollout.server.health import RolloutServerError
    from shardforge.rollout.server.shared_restart import generation_round
    from shardforge.rollout.types import SamplingParams
    from shardforge.rollout.vllm.server import VLLMServerRolloutEngine

    tokenizer = SimpleNamespace(eos_token_id=2, decode=lambda ids, skip_special_tokens=True: " ".join(map(str, ids)))
    options = VLLMOptions(mode="server", server_url=url, on_server_failure="restart", **FAST)
    engine = VLLMServerRolloutEngine(tmp, tokenizer, weights_root=tmp / "w", options=options)
    dist.barrier()  # both ranks have read the server's /v1/models
    if dist.get_rank() == 0:
        os.kill(pid, signal.SIGKILL)
        while True:  # until nothing listens any more
            try:
                urllib.request.urlopen(url + "/health", timeout=1).close()
                time.sleep(0.02)
            except OSError:
                break
    dist.barrier()
    params = SamplingParams(n=2, max_new_tokens=4, seed=7)
    try:
        generation_round(engine, lambda: engine.generate(PROMPTS[1], params) if dist.get_rank() == 1 else [])
    except RolloutServerError as exc:
        return str(exc)
    return None


def test_two_ranks_end_with_one_line_when_a_server_given_by_url_dies(tmp_path: Path) -> None:
    import subprocess

    from shardforge.mesh.testing import get_rank_pool
    from shardforge.rollout.vllm.server import _free_port

    port = _free_port()
    process = subprocess.Popen([sys.executable, str(STUB), "--port", str(port)])
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):  # until the stub answers
            try:
                urllib.request.urlopen(url + "/health", timeout=1).close()
                break
            except OSError:
                time.sleep(0.05)
        errors = get_rank_pool(2).run(_share_a_server_given_by_url, url, process.pid, tmp_path, timeout_s=60)
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()
    assert errors[0] is not None and errors[0] == errors[1], errors
    assert errors[0].startswith(f"rollout server {url} is down: /health: connection refused")
    assert "(seen by rank(s) [1])" in errors[0] and "only a server this trainer started can be restarted" in errors[0]


# ------------------------------------------------------------------------------------------ trainer
@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from shardforge.algorithms.testing import tiny_assets

    root = tmp_path_factory.mktemp("grpo_shared_server")
    tiny = tiny_assets(root, seed=11, max_operand=20, num_eval=16, data_seed=2)
    return {"model": str(root / "model"), "train": tiny["train"], "vocab_size": len(tiny["tokenizer"])}


def _grpo(assets: dict[str, Any], out: Path, layout: str, marker: Path | None) -> list[dict[str, Any]]:
    """Three GRPO steps (4 prompts x group_size 2, one request per episode) on a stub server that rank 0 starts;
    with ``marker``, it dies with step 2's requests in flight (after step 1's 8). The train metrics (rank 0)."""
    import torch.distributed as dist

    from shardforge.algorithms.config_io import build_config
    from shardforge.algorithms.trainers.grpo import GRPOConfig, run_grpo
    from shardforge.rollout.vllm.server import VLLMServerRolloutEngine

    die = [] if marker is None else ["--die-once", str(marker), "--die-after", "8"]

    def stub_command(self: Any, model_dir: Any, tokenizer: Any, dtype: str, seed: int, port: int) -> list[str]:
        return [sys.executable, str(STUB), "--port", str(port), "--vocab-size", str(assets["vocab_size"]), *die]

    data = {
        "model": assets["model"], "train_file": str(assets["train"]), "output_dir": str(out), "layout": layout,
        "steps": 3, "prompts_per_step": 4, "group_size": 2, "max_new_tokens": 4, "reward_fn": "zero",
        "progress": False, "save_every": 0, "export_hf_at_end": False, "rollout.engine": "vllm",
        "rollout.vllm": {"mode": "server", "server_python": sys.executable, "on_server_failure": "restart", **FAST},
        "engine": {"max_tokens_per_microbatch": 64},
    }  # fmt: skip
    original = VLLMServerRolloutEngine._server_command
    VLLMServerRolloutEngine._server_command = stub_command  # type: ignore[method-assign]
    try:
        if marker is not None and (not dist.is_initialized() or dist.get_rank() == 0):
            marker.touch()
        run_grpo(build_config(GRPOConfig, data))
    finally:
        VLLMServerRolloutEngine._server_command = original  # type: ignore[method-assign]
    if dist.is_initialized() and dist.get_rank() != 0:
        return []
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["split"] == "train"]


def test_grpo_on_two_ranks_continues_after_their_shared_server_dies(assets, tmp_path: Path) -> None:
    """FSDP 2 with a server that dies in step 2 trains on the rollouts of world 1 with a healthy server: the
    token-dependent metrics (entropy, behaviour KL: the zero reward leaves the weights as they are, and the
    stub's tokens depend on the weight version) agree to rel 1e-5 as in the other layout tests."""
    from shardforge.mesh.testing import get_rank_pool

    healthy = _grpo(assets, tmp_path / "d1", "d1", None)
    died = get_rank_pool(2).run(_grpo, assets, tmp_path / "d2", "d2", tmp_path / "die", timeout_s=180)[0]
    assert not (tmp_path / "die").exists(), "the server died once"
    assert [r["step"] for r in died] == [1, 2, 3]
    assert [r["rollout_server/restarts"] for r in died] == [0.0, 1.0, 0.0]
    assert died[1]["rollout_server/resent_requests"] in (4.0, 8.0)  # one rank's 2 prompts x 2 samples, or both
    for a, b in zip(healthy, died, strict=True):
        for key in ("tokens", "actor/entropy", "behaviour_kl", "rollout_corr/kl_k3", "rollout_version"):
            assert b[key] == pytest.approx(a[key], rel=1e-5), (a["step"], key, a[key], b[key])
