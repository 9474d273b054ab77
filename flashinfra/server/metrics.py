"""Prometheus metrics of the server (``/metrics``).

Owns one ``CollectorRegistry`` per app (so tests can run several servers in one process): latency
histograms measured in the server (time to first token, time per output token, end-to-end latency),
token and request counters, the lag of the server's event loop, and the engine's own figures (queue
length, running requests, cache usage, preemptions, the vision encoder's cache hits and misses, encode
time and cache size) read from the latest ``EngineStats`` at scrape time.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from flashinfra.engine.sched.messages import EngineStats

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                    5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class _EngineCollector:
    """Reads the engine's figures at scrape time, so they are never stale by more than one step."""

    def __init__(self, get_stats: Callable[[], EngineStats | None], get_pending: Callable[[], int],
                 get_health: Callable[[], tuple[bool, int]] | None = None):
        self._get_stats = get_stats
        self._get_pending = get_pending
        self._get_health = get_health

    def collect(self):
        stats = self._get_stats()
        pending = GaugeMetricFamily("flashinfra_server_pending_requests",
                                    "Sub-requests the server has sent to the engine and not seen finish")
        pending.add_metric([], self._get_pending())
        yield pending
        if self._get_health is not None:
            up, restarts = self._get_health()
            gauge = GaugeMetricFamily("flashinfra_engine_up", "1 while the engine process serves, else 0")
            gauge.add_metric([], 1.0 if up else 0.0)
            yield gauge
            counter = CounterMetricFamily("flashinfra_engine_restarts", "Engine processes restarted after a failure")
            counter.add_metric([], float(restarts))
            yield counter
            if not up:
                return  # the dead engine's last figures would only mislead
        if stats is None:
            return
        gauges = (
            ("flashinfra_num_requests_waiting", "Requests waiting in the engine's queue", stats.num_waiting),
            ("flashinfra_num_requests_running", "Requests in the engine's running batch", stats.num_running),
            ("flashinfra_cache_usage_ratio", "Fraction of paged KV cache blocks in use", stats.cache_usage),
            ("flashinfra_state_slot_usage_ratio", "Fraction of KDA state slots in use",
             stats.state_slot_usage),
            ("flashinfra_cache_blocks_free", "Paged cache blocks free (or held only by cached prefixes)",
             stats.num_blocks_free),
            ("flashinfra_transfers_held", "Finished requests whose cache waits for the decode engine's ack",
             stats.num_transfers_held),
            ("flashinfra_encoder_cache_bytes", "Bytes of vision encoder outputs held by the encoder cache",
             stats.encoder_cache_bytes),
        )
        for name, doc, value in gauges:
            gauge = GaugeMetricFamily(name, doc)
            gauge.add_metric([], float(value))
            yield gauge
        counters = (
            ("flashinfra_num_preemptions", "Requests preempted (recomputed) because the cache ran out",
             stats.num_preemptions_total),
            ("flashinfra_engine_prompt_tokens", "Prompt tokens the engine has taken in",
             stats.num_prompt_tokens_total),
            ("flashinfra_engine_generation_tokens", "Tokens the engine has generated",
             stats.num_generation_tokens_total),
            ("flashinfra_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache",
             stats.num_prefix_hit_tokens_total),
            ("flashinfra_transfers", "Request caches sent (prefill role) or imported (decode role)",
             stats.num_transfers_total),
            ("flashinfra_transfer_failures", "Request cache transfers that failed", stats.num_transfer_failures_total),
            ("flashinfra_encoder_cache_hits", "Images/videos a step needed and found in the encoder cache",
             stats.num_encoder_cache_hits_total),
            ("flashinfra_encoder_cache_misses", "Images/videos a step needed and had to encode",
             stats.num_encoder_cache_misses_total),
            ("flashinfra_encoded_items", "Images/videos run through the vision encoder",
             stats.num_encoded_items_total),
            ("flashinfra_encoder_seconds", "Time spent running the vision encoder", stats.encoder_seconds_total),
        )
        for name, doc, value in counters:
            counter = CounterMetricFamily(name, doc)
            counter.add_metric([], float(value))
            yield counter


class ServerMetrics:
    """The server's metrics; ``render()`` gives the Prometheus text format."""

    def __init__(self, get_stats: Callable[[], EngineStats | None], get_pending: Callable[[], int],
                 get_health: Callable[[], tuple[bool, int]] | None = None):
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("flashinfra_time_to_first_token_seconds",
                              "Time from request arrival to its first output token", buckets=_LATENCY_BUCKETS,
                              registry=r)
        self.tpot = Histogram("flashinfra_time_per_output_token_seconds",
                              "Mean time between output tokens of a finished sequence (after the first)",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("flashinfra_e2e_request_latency_seconds", "Time from arrival to the last token",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("flashinfra_prompt_tokens", "Prompt tokens of admitted requests",
                                     registry=r)
        self.generation_tokens = Counter("flashinfra_generation_tokens", "Output tokens sent to clients",
                                         registry=r)
        self.requests = Counter("flashinfra_request_success", "Finished sequences by finish reason",
                                ["finish_reason"], registry=r)
        self.rejected = Counter("flashinfra_requests_rejected", "Requests refused, by HTTP status",
                                ["status"], registry=r)
        self.loop_lag = Histogram("flashinfra_server_event_loop_lag_seconds",
                                  "How late the server's event loop wakes a 100 ms timer (time the loop was "
                                  "blocked: tokenizing inline, detokenizing, JSON, GIL contention)",
                                  buckets=_LATENCY_BUCKETS, registry=r)
        r.register(_EngineCollector(get_stats, get_pending, get_health))

    async def watch_event_loop(self, period_s: float = 0.1) -> None:
        """Runs for the server's lifetime: every streamed token passes through this one loop, so any
        time it is blocked delays every client."""
        while True:
            start = time.monotonic()
            await asyncio.sleep(period_s)
            self.loop_lag.observe(max(0.0, time.monotonic() - start - period_s))

    def render(self) -> bytes:
        return generate_latest(self.registry)
