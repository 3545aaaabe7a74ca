"""Per-tenant service metrics in Prometheus' text format (``GET /metrics``, `prometheus-client`).

What is counted: every queued request by tenant, kind (``ForwardBackward``, ``OptimStep``, ``Sample``, ...)
and outcome (``ok``, ``user_error``, ``server_error``); the tokens each tenant trained on (forward and
forward_backward datums) and the sequences it sampled; how long each kind of job ran and waited in the
queue; the size of the batch each forward(_backward) ran in; the queue's depth and each tenant's live training
clients. The registry is the service's own, so two services in one process (tests) do not share counters.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["CONTENT_TYPE_LATEST", "ServeMetrics"]

# Job durations on CPU (tiny models, tests) up to GPU batches of a big model.
_BUCKETS = (0.005, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


class ServeMetrics:
    """The service's counters; `render` gives the ``/metrics`` body."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "shardforge_serve_requests", "Queued requests by tenant, kind and outcome.",
            ["tenant", "kind", "outcome"], registry=self.registry,
        )  # fmt: skip
        self.tokens = Counter(
            "shardforge_serve_trained_tokens", "Tokens of forward / forward_backward datums accepted, by tenant.",
            ["tenant", "kind"], registry=self.registry,
        )  # fmt: skip
        self.samples = Counter(
            "shardforge_serve_sampled_sequences", "Sequences asked of sample requests accepted, by tenant.",
            ["tenant"], registry=self.registry,
        )  # fmt: skip
        self.run_seconds = Histogram(
            "shardforge_serve_job_seconds", "Seconds a queued job ran, by kind.", ["kind"],
            buckets=_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.wait_seconds = Histogram(
            "shardforge_serve_queue_wait_seconds", "Seconds a job waited in the queue before it ran, by kind.",
            ["kind"], buckets=_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.batch_size = Histogram(
            "shardforge_serve_batch_size", "Size of the batch (LoRA tenants over the shared base) each request ran in, by kind.",
            ["kind"], buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32, 64), registry=self.registry,
        )  # fmt: skip
        self.queue_depth = Gauge("shardforge_serve_queue_depth", "Jobs queued and not started.", registry=self.registry)
        self.training_clients = Gauge(
            "shardforge_serve_training_clients", "Live training clients (LoRA models), by tenant.", ["tenant"],
            registry=self.registry,
        )  # fmt: skip

    def job_done(
        self, tenant: str, kind: str, outcome: str, waited_s: float, ran_s: float, *, batch_size: int = 1
    ) -> None:
        self.requests.labels(tenant, kind, outcome).inc()
        if kind in ("Forward", "ForwardBackward"):
            self.batch_size.labels(kind).observe(batch_size)
        self.wait_seconds.labels(kind).observe(waited_s)
        self.run_seconds.labels(kind).observe(ran_s)

    def render(self, queue_depth: Callable[[], int], clients: Callable[[], dict[str, int]]) -> bytes:
        """The text exposition, with the gauges read now."""
        self.queue_depth.set(queue_depth())
        for tenant, count in clients().items():
            self.training_clients.labels(tenant).set(count)
        return generate_latest(self.registry)
