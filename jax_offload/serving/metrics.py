"""The server's Prometheus metrics (vLLM's names under `jax_offload:`), in a registry of the app's own."""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from jax_offload.outputs import RequestDelta
from jax_offload.serving.engine import EngineLoad

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0, 640.0)


class ServerMetrics:
    """Updated after every engine step (`observe`, on the engine's or the reader's thread) and by the handlers as
    requests come and go."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        p = "jax_offload:"
        self.running = Gauge(p + "num_requests_running", "Requests in the running batch.", registry=r)
        self.waiting = Gauge(p + "num_requests_waiting", "Requests waiting to be scheduled.", registry=r)
        self.swapped = Gauge(p + "num_requests_swapped", "Preempted requests whose KV waits in host memory.",
                             registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of requests added.", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Tokens generated.", registry=r)
        self.requests = Counter(p + "request_success", "Finished requests by finish reason.", ["finished_reason"],
                                registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "From a request's arrival to its first token.",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram(p + "time_per_output_token_seconds", "Between two tokens of a request.",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "From a request's arrival to its last token.",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.kv_usage = Gauge(p + "kv_cache_usage_perc", "Share of the KV block pool in use (0..1).", registry=r)
        self.prefix_queries = Counter(p + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                      registry=r)
        self.prefix_hits = Counter(p + "prefix_cache_hits", "Prompt tokens whose KV came from the prefix cache.",
                                   registry=r)
        self.host_read = Gauge(p + "host_store_bytes_read", "Bytes read from the offloaded KV store.", registry=r)
        self.host_written = Gauge(p + "host_store_bytes_written", "Bytes written to the offloaded KV store.",
                                  registry=r)
        self._arrived: dict[str, float] = {}
        self._last_token: dict[str, float] = {}

    def arrived(self, request_id: str, prompt_tokens: int) -> None:
        self._arrived[request_id] = self._last_token[request_id] = time.perf_counter()
        self.prompt_tokens.inc(prompt_tokens)

    def left(self, request_id: str) -> None:
        """A request gone without finishing (aborted, failed)."""
        self._arrived.pop(request_id, None)
        self._last_token.pop(request_id, None)

    def observe(self, deltas: list[RequestDelta], load: EngineLoad, host_bytes: tuple[int, int]) -> None:
        """A step's deltas, and the engine's load and host-store bytes after it."""
        now = time.perf_counter()
        for delta in deltas:
            rid = delta.request_id
            arrived, last = self._arrived.get(rid), self._last_token.get(rid)
            if arrived is None or last is None:  # not the server's, or gone meanwhile
                continue
            if delta.token_ids:
                self.generation_tokens.inc(len(delta.token_ids))
                (self.ttft if last == arrived else self.tpot).observe(now - last)
                self._last_token[rid] = now
            if delta.output is not None:
                self.e2e.observe(now - arrived)
                self.left(rid)
                self.requests.labels(delta.finish_reason).inc()
                self.prefix_queries.inc(len(delta.output.prompt_token_ids))
                self.prefix_hits.inc(delta.output.num_cached_tokens)
        self.running.set(load.running)
        self.waiting.set(load.waiting)
        self.swapped.set(load.swapped)
        self.kv_usage.set(load.kv_blocks_used / load.kv_blocks if load.kv_blocks else 0.0)
        read, written = host_bytes
        self.host_read.set(read)
        self.host_written.set(written)
