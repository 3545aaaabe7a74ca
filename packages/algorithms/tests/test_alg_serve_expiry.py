"""Checkpoint TTLs in `shardforge serve` (`serve.expiry`), driven by the official tinker SDK: ``ttl_seconds`` on the
save calls and ``RestClient.set_checkpoint_ttl_from_tinker_path``; an expired checkpoint leaves the listing, the
disk and every read; TTLs survive a service restart. The service's clock is moved forward instead of waiting
the API's one-hour minimum."""

from __future__ import annotations

import datetime
import os
import time

import pytest

tinker = pytest.importorskip(
    "tinker", reason="the tinker SDK is not installed (pip install 'shardforge-algorithms[serve]')"
)

from shardforge.algorithms.serve.config import ServeConfig  # noqa: E402
from shardforge.algorithms.serve.server import ServiceServer  # noqa: E402
from shardforge.algorithms.serve.service import TinkerService  # noqa: E402
from shardforge.algorithms.serve.tenants import TenantKeys  # noqa: E402

ALICE, BOB = "tml-alice-0123456789", "tml-bob-0123456789"
KEYS = {ALICE: "alice", BOB: "bob"}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    from shardforge.rollout.testing.tiny import tiny_model

    os.environ["TINKER_TELEMETRY"] = "0"
    root = tmp_path_factory.mktemp("serve_ttl")
    tiny = tiny_model(root)
    config = ServeConfig(model_dir=tiny["model"], base_model="tiny", output_dir=str(root / "out"), max_tokens=8)
    server = ServiceServer(TinkerService(config, TenantKeys(KEYS)), port=0).start()
    yield {"url": server.url, "server": server, "config": config, "root": root / "out"}
    server.stop()


def _listing(rest, model_id: str) -> dict[str, datetime.datetime | None]:
    return {c.checkpoint_id: c.expires_at for c in rest.list_checkpoints(model_id).result().checkpoints}


def _near(when: datetime.datetime | None, seconds_from_now: float) -> bool:
    return when is not None and abs(when.timestamp() - (time.time() + seconds_from_now)) < 120


def test_ttls_are_listed_set_and_expire(served) -> None:
    service = served["server"].service
    with tinker.ServiceClient(base_url=served["url"], api_key=ALICE) as client:
        trainer = client.create_lora_training_client(base_model="tiny", rank=4, seed=1).result()
        short = trainer.save_state("short", ttl_seconds=3600).result().path
        longer = trainer.save_state("longer", ttl_seconds=7 * 24 * 3600).result().path
        kept = trainer.save_state("kept").result().path
        sampler = trainer.save_weights_for_sampler("s", ttl_seconds=3600).result().path
        export = trainer.save_weights_external("e", ttl_seconds=3600).result().path
        rest = tinker.RestClient(base_url=served["url"], api_key=ALICE)
        listed = _listing(rest, trainer.model_id)
        assert _near(listed["weights/short"], 3600) and _near(listed["weights/longer"], 7 * 24 * 3600)
        assert _near(listed["sampler_weights/s"], 3600) and _near(listed["external_weights/e"], 3600)
        assert listed["weights/kept"] is None

        # Out of the API's range: a 400 that says the range, and nothing saved.
        for bad in (10, 11 * 365 * 24 * 3600):
            with pytest.raises(tinker.BadRequestError, match=r"from 3600 \(1 hour\) to 315360000"):
                trainer.save_state(f"bad-{bad}", ttl_seconds=bad).result()
        assert not any(name.startswith("weights/bad") for name in _listing(rest, trainer.model_id))

        # Another tenant's key cannot touch the TTL; the owner can remove it and set it again.
        with pytest.raises(tinker.NotFoundError):
            tinker.RestClient(base_url=served["url"], api_key=BOB).set_checkpoint_ttl_from_tinker_path(
                longer, None
            ).result()
        rest.set_checkpoint_ttl_from_tinker_path(longer, None).result()
        assert _listing(rest, trainer.model_id)["weights/longer"] is None
        rest.set_checkpoint_ttl_from_tinker_path(kept, 2 * 24 * 3600).result()
        assert _near(_listing(rest, trainer.model_id)["weights/kept"], 2 * 24 * 3600)

        # Two hours later: the one-hour checkpoints are gone from the listing, the disk and every read.
        folder = served["root"] / "alice" / trainer.model_id
        assert (folder / "weights" / "short").is_dir() and (folder / "external_weights" / "e").is_dir()
        service.expiry.clock = lambda: time.time() + 2 * 3600
        try:
            assert set(_listing(rest, trainer.model_id)) == {"weights/longer", "weights/kept"}
            assert not (folder / "weights" / "short").exists() and not (folder / "external_weights" / "e").exists()
            with pytest.raises(Exception, match="not a checkpoint of this API key"):
                client.create_training_client_from_state(short).result()
            with pytest.raises(tinker.NotFoundError):
                client.create_sampling_client(model_path=sampler).result()
            with pytest.raises(tinker.NotFoundError):
                rest.get_external_weights_urls(export).result()
            # A restart keeps the TTLs (they live on disk next to the checkpoints).
            restarted = ServiceServer(TinkerService(served["config"], TenantKeys(KEYS)), port=0).start()
            try:
                again = tinker.RestClient(base_url=restarted.url, api_key=ALICE)
                assert _near(_listing(again, trainer.model_id)["weights/kept"], 2 * 24 * 3600)
            finally:
                restarted.stop()
        finally:
            service.expiry.clock = time.time
        assert client.create_training_client_from_state(kept).result().model_id  # never expired: loads


def test_the_background_sweep_deletes_every_tenants_expired_checkpoints(served) -> None:
    service = served["server"].service
    with tinker.ServiceClient(base_url=served["url"], api_key=BOB) as client:
        trainer = client.create_lora_training_client(base_model="tiny", rank=4, seed=2).result()
        trainer.save_state("a", ttl_seconds=3600).result()
        trainer.save_state("b", ttl_seconds=3 * 3600).result()
    folder = served["root"] / "bob" / trainer.model_id / "weights"
    service.expiry.clock = lambda: time.time() + 2 * 3600
    try:
        assert service.expiry.sweep() == 1  # no request needed: the service runs this every SWEEP_EVERY_S
    finally:
        service.expiry.clock = time.time
    assert sorted(p.name for p in folder.iterdir()) == ["b"]
