"""Model-based and composed rewards: the HTTP judge against a local stub server (retries, backoff,
errors that fail at once, unparseable replies, the JSON API), weighted reward sums with per-term
means, a trained reward model scoring rollouts through a forward-only engine (= the HF model on each
sequence alone), and a GRPO run with all three whose reward is their weighted sum."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


class _Judge:
    """What the stub server does: fail the first ``fail_first`` requests with ``fail_status``, wait
    ``delay_s``, then answer ``reply`` (a chat completion with that text, or a raw JSON body)."""

    def __init__(self) -> None:
        self.fail_first, self.fail_status, self.delay_s = 0, 503, 0.0
        self.reply: Any = "Score: 1"
        self.requests: list[dict[str, Any]] = []


@pytest.fixture
def judge() -> Iterator[tuple[_Judge, str]]:
    state = _Judge()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            state.requests.append({"path": self.path, "body": body})
            if len(state.requests) <= state.fail_first:
                self.send_response(state.fail_status)
                self.end_headers()
                self.wfile.write(b"busy")
                return
            time.sleep(state.delay_s)
            if isinstance(state.reply, str):
                answer: Any = {"choices": [{"message": {"role": "assistant", "content": state.reply}}]}
            else:
                answer = state.reply
            data = json.dumps(answer).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state, f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()


# ------------------------------------------------------------------------------------------ HTTP judge
def test_judge_reads_the_last_score_and_sends_the_filled_template(judge) -> None:
    from shardforge.rewards.http_judge import HTTPJudgeReward

    state, url = judge
    state.reply = "The answer 12 is wrong... Score: 7"
    fn = HTTPJudgeReward(url, model="m", template="Q={prompt} A={response} R={reference} {json: kept}", scale=0.1)
    assert fn("1+1", "2", "2") == pytest.approx(0.7)
    [request] = state.requests
    assert request["path"] == "/v1/chat/completions"
    assert request["body"]["model"] == "m" and request["body"]["temperature"] == 0.0
    assert request["body"]["messages"] == [{"role": "user", "content": "Q=1+1 A=2 R=2 {json: kept}"}]


def test_judge_retries_busy_answers_with_backoff_then_fails_counted(judge) -> None:
    from shardforge.rewards.http_judge import HTTPJudgeReward

    state, url = judge
    state.fail_first = 2
    fn = HTTPJudgeReward(url, max_retries=2, backoff_s=0.05)
    began = time.perf_counter()
    assert fn("p", "r", "x") == 1.0
    assert time.perf_counter() - began >= 0.05 + 0.1  # backoff 0.05 * 2**0 + 0.05 * 2**1
    assert fn.pop_stats() == {"requests": 3.0, "retries": 2.0, "unparseable": 0.0}
    state.requests.clear()
    state.fail_first = 5
    with pytest.raises(RuntimeError, match=r"HTTP 503 .* after 3 tries"):
        HTTPJudgeReward(url, max_retries=2, backoff_s=0.0)("p", "r", "x")


def test_judge_client_errors_fail_at_once_and_timeouts_retry(judge) -> None:
    from shardforge.rewards.http_judge import HTTPJudgeReward

    state, url = judge
    state.fail_first, state.fail_status = 1, 400
    with pytest.raises(RuntimeError, match="HTTP 400"):
        HTTPJudgeReward(url, max_retries=3, backoff_s=0.0)("p", "r", "x")
    assert len(state.requests) == 1  # a 4xx is not retried
    state.fail_first, state.delay_s = 0, 0.5
    fn = HTTPJudgeReward(url, max_retries=1, backoff_s=0.0, request_timeout_s=0.1)
    with pytest.raises(RuntimeError, match="unreachable after 2 tries"):
        fn("p", "r", "x")
    assert fn.pop_stats()["retries"] == 1.0


def test_unparseable_replies_and_the_json_api(judge) -> None:
    from shardforge.rewards.http_judge import HTTPJudgeReward, JudgeReplyError

    state, url = judge
    state.reply = "I cannot decide."
    fn = HTTPJudgeReward(url, score_pattern=r"Score:\s*(\d+)")
    with pytest.raises(JudgeReplyError, match="no score matching"):
        fn("p", "r", "x")
    assert fn.pop_stats()["unparseable"] == 1.0
    state.reply = {"reward": 0.25}
    assert HTTPJudgeReward(url + "/score", api="json")("p", "r", "x") == 0.25
    assert state.requests[-1]["body"] == {"prompt": "p", "response": "r", "reference": "x"}
    for bad, match in (({"url": "ftp://x"}, "http://"), ({"url": url, "score_pattern": r"\d+"}, "one group")):
        with pytest.raises(ValueError, match=match):
            HTTPJudgeReward(**bad)


def test_a_dead_judge_scores_zero_under_the_reward_runner() -> None:
    import socket

    from shardforge.rewards.guarded import GuardedReward, RewardConfig
    from shardforge.rewards.http_judge import HTTPJudgeReward

    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    guarded = GuardedReward(
        HTTPJudgeReward(f"http://127.0.0.1:{port}/v1", max_retries=1, backoff_s=0.0), RewardConfig()
    )
    assert guarded.score_many([("p", "r", "x")] * 3) == [0.0, 0.0, 0.0]
    stats = guarded.pop_stats()
    assert stats["reward/failures"] == 3.0 and stats["reward/retries"] == 3.0
    guarded.close()


# ------------------------------------------------------------------------------------------ composition
def test_weighted_sum_and_per_term_means() -> None:
    from shardforge.algorithms.trainers.rl.metrics import StepMetrics
    from shardforge.algorithms.trainers.rl.step_stats import add_reward_call_stats
    from shardforge.rewards.compose import CompositeReward, RewardTermConfig
    from shardforge.rewards.guarded import GuardedReward, RewardConfig

    composite = CompositeReward(
        (RewardTermConfig(name="exact_match", weight=1.0), RewardTermConfig(name="boxed_format", weight=-0.5))
    )
    guarded = GuardedReward(composite, RewardConfig())
    items = [("p", "4", "4"), ("p", "\\boxed{4}", "4"), ("p", "5", "4"), ("p", "\\boxed{5}", "4")]
    # exact_match: 1, 0 (not a bare number), 0, 0; boxed: 0, 1, 0, 1
    assert guarded.score_many(items) == [1.0, -0.5, 0.0, -0.5]
    metrics = StepMetrics()
    add_reward_call_stats(metrics, guarded)
    stats = metrics.reduce(None)
    assert stats["reward/exact_match_mean"] == pytest.approx(0.25)
    assert stats["reward/boxed_format_mean"] == pytest.approx(0.5)
    assert stats["reward/calls"] == 4.0
    guarded.close()


def test_bad_reward_terms_are_refused(tmp_path: Path) -> None:
    from shardforge.algorithms.config_io import build_config
    from shardforge.algorithms.trainers.grpo import GRPOConfig
    from shardforge.algorithms.trainers.rl.common import check_rollout_batch
    from shardforge.rewards.compose import CompositeReward, RewardTermConfig, make_reward

    with pytest.raises(ValueError, match="plain function and takes no args"):
        make_reward("exact_match", {"x": 1})
    with pytest.raises(ValueError, match=r"could not be built with args \['nope'\].*'url'"):
        make_reward("http_judge", {"nope": 1})
    with pytest.raises(ValueError, match="each name once"):
        CompositeReward((RewardTermConfig(name="zero"), RewardTermConfig(name="zero")))
    config = build_config(
        GRPOConfig,
        {"model": "m", "train_file": "x", "output_dir": str(tmp_path), "reward_fn": "math_verify",
         "rewards": [{"name": "exact_match"}]},
    )  # fmt: skip
    prompts = SimpleNamespace(ids=[[1, 2]])
    with pytest.raises(ValueError, match="set reward_fn or rewards, not both"):
        check_rollout_batch(config, prompts, 1, 1000, "budget")  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------ reward model
@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from transformers import AutoModelForTokenClassification, AutoTokenizer

    from shardforge.algorithms.testing import tiny_assets

    root = tmp_path_factory.mktemp("rm")
    assets = tiny_assets(root / "a", seed=3, tokenizer_dir="model")
    model = AutoModelForTokenClassification.from_pretrained(assets["model"], num_labels=1)
    with torch.no_grad():
        model.score.weight.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(0))
    rm = root / "rm"
    model.save_pretrained(rm)
    AutoTokenizer.from_pretrained(assets["model"]).save_pretrained(rm)
    return {"rm": str(rm), "policy": assets["model"], "train": str(assets["train"]), "eval": str(assets["eval"])}


def _trajectories() -> list[Any]:
    gen = torch.Generator().manual_seed(1)
    return [
        SimpleNamespace(token_ids=torch.randint(4, 20, (int(torch.randint(3, 9, (1,), generator=gen)),), generator=gen).tolist())
        for _ in range(6)
    ]  # fmt: skip


def _score(rm: str, layout: str) -> list[float]:
    from shardforge.algorithms.trainers.rl.model_rewards import RewardModelConfig, RewardModelScorer
    from shardforge.engine import EngineConfig

    scorer = RewardModelScorer(
        RewardModelConfig(path=rm), layout, EngineConfig(max_tokens_per_microbatch=16), vocab_size=_vocab(rm)
    )
    trajectories = _trajectories()
    mine = trajectories[scorer.engine.dp_rank :: scorer.engine.dp_size]
    return scorer.scores(mine).tolist()


def _vocab(path: str) -> int:
    return int(json.loads((Path(path) / "config.json").read_text())["vocab_size"])


def test_reward_model_scores_are_the_hf_models_last_token_values(reward_model_dir) -> None:
    from transformers import AutoModelForTokenClassification

    from shardforge.mesh.testing import get_rank_pool

    model = AutoModelForTokenClassification.from_pretrained(reward_model_dir["rm"]).eval()
    with torch.no_grad():
        expected = [float(model(input_ids=torch.tensor([t.token_ids])).logits[0, -1, 0]) for t in _trajectories()]
    single = _score(reward_model_dir["rm"], "d1")  # micro-batches of 16 tokens: several per call
    assert max(expected) - min(expected) > 0.1  # a head that tells sequences apart
    torch.testing.assert_close(torch.tensor(single), torch.tensor(expected), rtol=1e-5, atol=1e-5)
    halves = get_rank_pool(2).run(_score, reward_model_dir["rm"], "d2", timeout_s=300)
    sharded = [halves[i % 2][i // 2] for i in range(len(expected))]  # rank r scored trajectories r::2
    torch.testing.assert_close(torch.tensor(sharded), torch.tensor(expected), rtol=1e-5, atol=1e-5)


def test_a_causal_lm_is_refused_as_a_reward_model(reward_model_dir) -> None:
    from shardforge.algorithms.trainers.rl.model_rewards import check_reward_model_dir

    with pytest.raises(ValueError, match=r"no reward head \(score.weight\)"):
        check_reward_model_dir(reward_model_dir["policy"])
    check_reward_model_dir(reward_model_dir["rm"])


def test_grpo_reward_is_the_weighted_sum_of_verifier_judge_and_reward_model(reward_model_dir, judge, tmp_path) -> None:
    from shardforge.algorithms.config_io import build_config
    from shardforge.algorithms.trainers.grpo import GRPOConfig, run_grpo

    state, url = judge
    state.reply = "Score: 1"
    out = tmp_path / "out"
    config = build_config(GRPOConfig, {
        "model": reward_model_dir["policy"], "train_file": reward_model_dir["train"], "output_dir": str(out),
        "layout": "d1", "steps": 2, "prompts_per_step": 4, "group_size": 2, "max_new_tokens": 4,
        "progress": False, "export_hf_at_end": False,
        "rewards": [{"name": "exact_match", "weight": 1.0},
                    {"name": "http_judge", "weight": 0.5, "args": {"url": url, "max_retries": 0}}],
        "reward_model": {"path": reward_model_dir["rm"], "weight": 0.25},
        "engine": {"max_tokens_per_microbatch": 256},
    })  # fmt: skip
    run_grpo(config)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["split"] == "train"]
    assert len(train) == 2 and len(state.requests) == 2 * 4 * 2  # every rollout went to the judge
    for r in train:
        assert r["reward/http_judge_mean"] == 1.0 and r["reward/failures"] == 0.0
        assert abs(r["reward_model/score_mean"]) > 1e-3
        expected = r["reward/exact_match_mean"] + 0.5 * 1.0 + 0.25 * r["reward_model/score_mean"]
        assert r["reward_mean"] == pytest.approx(expected, abs=1e-5)
