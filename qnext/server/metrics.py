"""Prometheus metrics, named `qnext:*` after vLLM's `vllm:*`.

Engine counters and pool usage are read at scrape time from the snapshot the engine thread publishes; latency
histograms are observed by the engine thread as outputs are delivered. Each server has its own registry."""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)
_TPOT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                 1.0, 2.5, 5.0)

# (metric name, CacheStats field, help)
_CACHE_COUNTERS = [
    ("qnext:prefix_cache_queries", "prompt_tokens", "Prompt tokens looked up in the prefix cache."),
    ("qnext:prefix_cache_hits", "reused_tokens", "Prompt tokens served from the prefix cache (KV + state)."),
    ("qnext:prefix_cache_transferred", "transferred_tokens",
     "Prompt tokens a prefill server computed whose KV was moved here (prefill/decode disaggregation)."),
    ("qnext:prefix_cache_kv_matched", "kv_matched_tokens", "Prompt tokens whose KV blocks matched the cache."),
    ("qnext:prefix_cache_lost_to_missing_state", "lost_to_missing_state_tokens",
     "Prompt tokens whose KV matched but were recomputed for want of a state snapshot."),
    ("qnext:prefix_snapshots_captured", "snapshots_captured", "State snapshots captured."),
    ("qnext:prefix_snapshots_restored", "snapshots_restored", "State snapshots restored into a request."),
    ("qnext:prefix_snapshots_evicted", "snapshots_evicted", "State snapshots evicted by the snapshot pool's LRU."),
    ("qnext:prefix_snapshots_invalidated", "snapshots_invalidated",
     "State snapshots dropped because their terminal KV block was evicted."),
    ("qnext:kv_blocks_evicted", "kv_blocks_evicted", "Cached KV blocks evicted."),
]
_ENGINE_COUNTERS = [
    ("qnext:prompt_tokens", "num_prompt_tokens", "Prompt tokens of the requests the engine accepted."),
    ("qnext:generation_tokens", "num_generated_tokens", "Tokens generated."),
    ("qnext:engine_steps", "num_steps", "Engine steps run."),
    ("qnext:pd_transferred_requests", "num_transferred_requests", "Requests prefilled by a prefill server (PD)."),
    ("qnext:pd_transfer_bytes", "transfer_bytes", "Bytes of KV blocks and states fetched from prefill servers."),
    ("qnext:pd_transfer_min_bytes", "transfer_min_bytes",
     "The minimum for those requests: the KV blocks this cache lacked plus one state each."),
    ("qnext:pd_transfer_seconds", "transfer_seconds", "Seconds spent fetching them (on the decode server: worker threads)."),
    # MTP speculative decoding (vLLM's spec_decode_* counters): acceptance length = 1 + accepted / drafts
    ("qnext:spec_decode_num_drafts", "num_spec_rows", "Rows of speculative steps (each verified its drafts once)."),
    ("qnext:spec_decode_num_draft_tokens", "num_draft_tokens", "Draft tokens verified."),
    ("qnext:spec_decode_num_accepted_tokens", "num_accepted_draft_tokens", "Draft tokens accepted."),
    ("qnext:vision_tower_runs", "num_tower_runs", "Pictures encoded by the vision tower."),
    ("qnext:vision_tower_seconds", "tower_seconds", "Wall time of the vision tower's runs."),
    ("qnext:encoder_cache_hits", "num_encoder_cache_hits", "Pictures whose tower output came from the encoder cache."),
]
_USAGE_GAUGES = [
    ("qnext:kv_cache_usage_perc", "kv_cache_usage", "Fraction of KV blocks referenced by requests (0-1)."),
    ("qnext:state_slots_usage_perc", "state_slots_usage", "Fraction of live recurrent-state rows in use (0-1)."),
    ("qnext:snapshot_pool_usage_perc", "snapshot_pool_usage", "Fraction of snapshot pool rows in use (0-1)."),
    ("qnext:kv_cache_blocks_cached", "kv_blocks_cached", "KV blocks holding a cached prefix (free or not)."),
]


class ServerMetrics:
    def __init__(self, async_engine_snapshot, model_name: str, labels: dict | None = None):
        """async_engine_snapshot() -> EngineSnapshot (engine_loop); labels: more labels on every sample (a data
        parallel replica's engine="i")."""
        self.registry = CollectorRegistry()
        self._snapshot = async_engine_snapshot
        self._labels = {"model_name": model_name, **(labels or {})}
        labels = list(self._labels)
        self.ttft = Histogram("qnext:time_to_first_token_seconds", "Time from arrival to the first token.",
                              labels, buckets=_LATENCY_BUCKETS, registry=self.registry).labels(**self._labels)
        self.tpot = Histogram("qnext:time_per_output_token_seconds",
                              "Mean time between output tokens of a finished request.", labels,
                              buckets=_TPOT_BUCKETS, registry=self.registry).labels(**self._labels)
        self.e2e = Histogram("qnext:e2e_request_latency_seconds", "Time from arrival to the last token.", labels,
                             buckets=_LATENCY_BUCKETS, registry=self.registry).labels(**self._labels)
        self._finished = Counter("qnext:request_success", "Requests finished, by finish reason.",
                                 labels + ["finished_reason"], registry=self.registry)
        self._http_errors = Counter("qnext:request_errors", "Requests answered with an error, by HTTP status.",
                                    labels + ["status"], registry=self.registry)
        self.registry.register(_EngineCollector(self._snapshot, self._labels))

    # ---- engine-thread observer (engine_loop.AsyncEngine) -------------------------------------------------
    def on_first_token(self, stream) -> None:
        self.ttft.observe(stream.first_token_time - stream.arrival_time)

    def on_finish(self, stream, out) -> None:
        now = time.perf_counter()
        self.e2e.observe(now - stream.arrival_time)
        num_tokens = len(out.outputs[0].token_ids)
        if stream.first_token_time is not None and num_tokens > 1:
            self.tpot.observe((now - stream.first_token_time) / (num_tokens - 1))
        self._finished.labels(**self._labels, finished_reason=out.outputs[0].finish_reason or "unknown").inc()

    # ---- HTTP side ----------------------------------------------------------------------------------------
    def count_error(self, status: int) -> None:
        self._http_errors.labels(**self._labels, status=str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    def __init__(self, snapshot, labels: dict):
        self._snapshot, self._labels = snapshot, labels

    def collect(self):
        snap = self._snapshot()
        names, values = list(self._labels), list(self._labels.values())

        def gauge(name, doc, value):
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(values, value)
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(name, doc, labels=names)
            c.add_metric(values, value)
            return c

        yield gauge("qnext:num_requests_running", "Requests in the running batch.", snap.num_running)
        yield gauge("qnext:num_requests_waiting", "Requests waiting to be scheduled.", snap.num_waiting)
        for name, key, doc in _USAGE_GAUGES:
            if key in snap.usage:
                yield gauge(name, doc, snap.usage[key])
        for name, key, doc in _CACHE_COUNTERS:
            if key in snap.cache_stats:
                yield counter(name, doc, snap.cache_stats[key])
        for name, key, doc in _ENGINE_COUNTERS:
            if key in snap.engine_stats:
                yield counter(name, doc, snap.engine_stats[key])
