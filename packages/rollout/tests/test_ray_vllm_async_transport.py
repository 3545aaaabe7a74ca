"""Which weight transport the vLLM server actor's client gets (``rollout.placement: disaggregated``, issue 41):
asynchronous (and streaming) rollouts load disk versions when their generator asks, so ``weight_transport: auto``
becomes ``disk`` there; synchronous runs keep ``auto`` (the client picks the collective transport itself). The client
class is replaced by a recorder: no Ray or vLLM needed (tests_vllm/test_vllm_streaming.py runs the real one)."""

from __future__ import annotations

from typing import Any

import pytest

from shardforge.rollout import factory
from shardforge.rollout.config import RolloutConfig, VLLMOptions
from shardforge.rollout.ray import vllm_server
from shardforge.rollout.ray.placement import ROLLOUT_ACTORS_ENV


class _Recorder:
    def __init__(self, actor_name: str, model_dir: Any, tokenizer: Any, *, options: VLLMOptions, **kwargs: Any) -> None:
        self.actor_name, self.options, self.kwargs = actor_name, options, kwargs


@pytest.mark.parametrize(
    ("transport", "asynchronous", "expected"),
    [("auto", True, "disk"), ("auto", False, "auto"), ("disk", False, "disk"), ("disk", True, "disk")],
)
def test_asynchronous_rollouts_give_the_server_actor_disk_versions(
    monkeypatch: pytest.MonkeyPatch, transport: str, asynchronous: bool, expected: str
) -> None:
    monkeypatch.setattr(vllm_server, "RayVLLMServerEngine", _Recorder)
    monkeypatch.setenv(ROLLOUT_ACTORS_ENV, "shardforge-rollout-0")
    config = RolloutConfig(
        engine="vllm", placement="disaggregated", vllm=VLLMOptions(mode="server", weight_transport=transport)
    )
    client = factory._ray_client(
        config, "model", None, weights_root="w", seed=0, timeout_s=1.0, asynchronous=asynchronous
    )
    assert isinstance(client, _Recorder) and client.actor_name == "shardforge-rollout-0"
    assert client.options.weight_transport == expected
    assert client.kwargs["weights_root"] == "w"
