"""`GET /metrics`: the server's figures in Prometheus' text format (prometheus_client), in a
registry of their own (one per server, so several in one process do not share counts)."""

from collections.abc import Callable

import prometheus_client as prom

# Seconds: from a few milliseconds (a cached prefix on an accelerator) to minutes (a long
# prompt on a busy CPU).
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
# A request's outcome: how its first choice finished (ok: answered, for /v1/models), or why it
# was not served.
OUTCOMES = ("stop", "length", "tool_calls", "ok", "cancelled", "invalid", "unauthorized",
            "not_found", "overloaded", "unavailable", "error")  # fmt: skip


class Metrics:
  def __init__(self):
    self.registry = r = prom.CollectorRegistry()
    self.requests = prom.Counter(
      "zoo_requests", "HTTP requests to the API by endpoint and outcome", ["endpoint", "outcome"],
      registry=r,
    )  # fmt: skip
    self.ttft = prom.Histogram(
      "zoo_time_to_first_token_seconds", "From a request's arrival to its first token",
      buckets=TTFT_BUCKETS, registry=r,
    )  # fmt: skip
    self.tpot = prom.Histogram(
      "zoo_time_per_output_token_seconds", "A choice's time per token after its first",
      buckets=TPOT_BUCKETS, registry=r,
    )  # fmt: skip
    self.prompt_tokens = prom.Counter("zoo_prompt_tokens", "Prompt tokens read", registry=r)
    self.cached_tokens = prom.Counter(
      "zoo_cached_prompt_tokens", "Prompt tokens reused from a cached prefix", registry=r
    )
    self.output_tokens = prom.Counter("zoo_generation_tokens", "Tokens generated", registry=r)
    self.slots = prom.Gauge("zoo_slots", "The engine's slots", registry=r)
    self.slots_in_use = prom.Gauge("zoo_slots_in_use", "Slots holding a request", registry=r)
    self.queue = prom.Gauge(
      "zoo_queue_length", "Requests waiting for a slot (taken, not yet admitted)", registry=r
    )
    self.ready = prom.Gauge("zoo_ready", "1 once the model is loaded and warm", registry=r)

  def watch(self, *, slots: int, in_use: Callable[[], int], waiting: Callable[[], int]):
    """The gauges read at each scrape from the worker."""
    self.slots.set(slots)
    self.slots_in_use.set_function(in_use)
    self.queue.set_function(waiting)
    self.ready.set(1)

  def count(self, endpoint: str, outcome: str):
    self.requests.labels(endpoint, outcome).inc()

  def text(self) -> bytes:
    return prom.generate_latest(self.registry)


CONTENT_TYPE = prom.CONTENT_TYPE_LATEST
