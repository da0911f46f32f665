"""The Prometheus metrics of `ftengine serve`."""

from __future__ import annotations


class Metrics:
    """The service's Prometheus metrics; with per_model (several models in one service) each is
    labelled with its model."""

    def __init__(self, *, per_model: bool = False):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
        self.per_model = per_model
        m = ["model"] if per_model else []
        self.registry = r = CollectorRegistry()
        self.requests = Counter("ftengine_requests", "HTTP requests by route and status", [*m, "route", "status"],
                                registry=r)
        self.inputs = Counter("ftengine_inputs", "Texts (or token sequences) embedded", m, registry=r)
        self.tokens = Counter("ftengine_tokens", "Tokens embedded, special tokens included", m, registry=r)
        self.latency = Histogram("ftengine_request_duration_seconds", "Request latency", [*m, "route"], registry=r,
                                 buckets=(.001, .002, .005, .01, .02, .05, .1, .2, .5, 1, 2, 5, 10, 30))
        self.batch_texts = Histogram("ftengine_batch_texts", "Texts per device batch", m, registry=r,
                                     buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024))
        self.batch_requests = Histogram("ftengine_batch_requests", "Requests sharing one device batch", m,
                                        registry=r, buckets=(1, 2, 3, 4, 8, 16, 32, 64))
        self.batch_tokens = Histogram("ftengine_batch_tokens", "Tokens per device batch", m, registry=r,
                                      buckets=(64, 256, 1024, 4096, 16384, 65536))
        self.queue_depth = Gauge("ftengine_queue_depth", "Requests accepted and not yet answered", m, registry=r,
                                 multiprocess_mode="livesum")

    def of(self, family: str, model: str, *labels):
        """A model's metric of a family, labelled with the model where several share these metrics."""
        metric = getattr(self, family)
        names = ((model,) if self.per_model else ()) + labels
        return metric.labels(*names) if names else metric

    def observe_batch(self, model: str, texts: int, requests: int, tokens: int):
        """One device batch of a model's engine (its on_batch observer)."""
        for family, value in (("batch_texts", texts), ("batch_requests", requests), ("batch_tokens", tokens)):
            self.of(family, model).observe(value)
