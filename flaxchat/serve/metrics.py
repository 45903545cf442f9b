"""`GET /metrics`: what the server does, in Prometheus' text format (the prometheus-client package), for an operator
to scrape (docs/serving.md, "Metrics").

Counters and gauges are read from the scheduler's own counters at each scrape (nothing is counted twice); the
latency histograms are filled as each request ends, from the times its `Request` recorded.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# (name, help, the scheduler counter it reads)
COUNTERS = (
    ("prompt_tokens", "Prompt tokens admitted (prefilled or continued from a kept row).", "prompt_tokens"),
    ("generation_tokens", "Tokens generated, tool outputs forced into replies included.", "tokens"),
    ("prefix_cache_hits", "Requests that continued a kept row's cache (prefix reuse).", "prefix_hits"),
    ("prefix_cache_misses", "Requests prefilled whole while prefix reuse was on.", "prefix_misses"),
    ("prefix_cache_tokens_saved", "Prompt tokens not prefilled because a kept row held them.", "prefix_tokens_saved"),
    ("decode_chunks", "Decode chunks run (jitted calls of the decode loop).", "chunks"),
    ("rows_moved", "Rows moved down the batch to keep decode chunks narrow.", "moved"),
    ("scheduler_failures", "Scheduler iterations that failed (their requests got an error).", "failures"),
)
# (name, help, the stats() key it reads)
GAUGES = (
    ("queue_length", "Requests waiting for a slot.", "queued"),
    ("active_rows", "Slots generating now.", "active"),
    ("slots", "Slots of the batched KV cache.", "slots"),
    ("kept_rows", "Free slots whose cache is kept for a conversation's next turn.", "kept"),
    ("programs_compiling", "Programs the background thread has still to compile.", "programs_compiling"),
)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    """One app's registry: the scheduler's counters and gauges, read at each scrape, and histograms that
    `observe(request)` fills when a request ends."""

    def __init__(self, server):
        self.server = server
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(self)
        self.requests = Counter(
            "flaxchat_requests", "Requests ended, by outcome.", ["outcome"], registry=self.registry
        )  # stop | length | cancelled | error
        histogram = lambda name, text: Histogram(name, text, buckets=LATENCY_BUCKETS, registry=self.registry)
        self.ttft = histogram("flaxchat_time_to_first_token_seconds", "From submission to the first generated token.")
        self.per_token = histogram(
            "flaxchat_time_per_output_token_seconds", "A reply's time from its first to its last token, per token."
        )
        self.e2e = histogram("flaxchat_request_duration_seconds", "From submission to the end of the reply.")

    def collect(self):
        """The scheduler's counters and gauges as they are now (prometheus_client's custom-collector hook)."""
        stats = self.server.scheduler.stats()
        for name, text, key in COUNTERS:
            if key in stats:
                yield CounterMetricFamily(f"flaxchat_{name}", text, value=stats[key])
        for name, text, key in GAUGES:
            if key in stats:
                yield GaugeMetricFamily(f"flaxchat_{name}", text, value=stats[key])
        if "decode_step_ms" in stats:
            yield GaugeMetricFamily(
                "flaxchat_decode_step_seconds", "A decode step's measured time.", value=stats["decode_step_ms"] / 1000
            )
        connections = "Open WebSockets and in-flight HTTP requests."
        yield GaugeMetricFamily("flaxchat_connections", connections, value=self.server.connections)

    def observe(self, request, event: dict) -> None:
        """Count a request's end (its "done" or "error" event) and its latencies."""
        self.requests.labels("error" if event["type"] == "error" else event["finish_reason"]).inc()
        if request.first_token_at is None or request.finished_at is None:
            return
        self.ttft.observe(request.first_token_at - request.submitted_at)
        self.e2e.observe(request.finished_at - request.submitted_at)
        if request.completion_tokens > 1:
            self.per_token.observe((request.finished_at - request.first_token_at) / (request.completion_tokens - 1))

    def exposition(self) -> tuple[bytes, str]:
        """(the metrics in Prometheus' text format, its content type)."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
