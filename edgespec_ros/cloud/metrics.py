"""The verifier's Prometheus metrics (GET /metrics; the Ray front end too), with prometheus_client.

Three kinds, all in one registry per server (several servers in one process never share counts):

- **Speculative decoding, vLLM's names and meanings**, so dashboards made for vLLM work:
  ``vllm:spec_decode_num_drafts_total`` (verification rounds with drafts),
  ``vllm:spec_decode_num_draft_tokens_total``, ``vllm:spec_decode_num_accepted_tokens_total`` and
  ``vllm:spec_decode_num_accepted_tokens_per_pos_total{position}`` (accepted drafts at each
  position, 0-based). Mean acceptance length = 1 + accepted / drafts. Labelled ``model_name``
  (the target, as WELCOME names it) and ``tenant`` (a hash of the auth token, never the token;
  ``anonymous`` with auth off; at most MAX_TENANTS distinct values, then ``other``).
- **Latency and load histograms** (``edgespec_verifier_*``): a round's queue wait and compute, prefill
  time, sessions per batched pass, a decision's length in tokens, a session's length, and each
  session's early-exit guess hit rate; with counters for the exits and the lossy WISV acceptances.
- **The server's status** (sessions, refusals, queue depth, ...), read at scrape time.

``docs/operating.md`` says what each figure means and what to alert on; ``docs/grafana.json`` is a
dashboard over them (test_metrics checks every metric it queries exists).
"""
from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "edgespec_verifier_"
MAX_TENANTS = 64  # distinct tenant label values; more tenants share "other" (bounded cardinality)
MAX_POSITION = 63  # accepted-per-position labels 0..63 (the protocol's longest block)
ANONYMOUS, OTHER = "anonymous", "other"

# status() key -> Prometheus metric name (prefixed edgespec_verifier_), type, help.
STATUS_METRICS = {
    "sessions": ("sessions", "gauge", "open sessions (HELLO accepted)"),
    "tenants": ("tenants", "gauge", "auth tokens with open sessions"),
    "handshaking": ("handshaking", "gauge", "connections that have not sent an accepted HELLO"),
    "connections": ("connections", "gauge", "TCP connections open (the front door's count)"),
    "half_open": ("half_open_connections", "gauge", "connections whose HTTP upgrade request is not yet read"),
    "refused_at_accept": ("refused_at_accept", "counter",
                          "connections closed as accepted: the connection cap, or too many half-open from one address"),
    "admitted_on_reserve": ("connections_on_reserve", "counter",
                            "connections let in on the share of the cap kept for addresses that authenticated before"),
    "slow_headers_closed": ("slow_headers_closed", "counter",
                            "connections closed for not sending their upgrade request within --header-timeout"),
    "accept_errors": ("accept_errors", "counter", "failed accept() calls (out of file descriptors)"),
    "queued_jobs": ("queued_jobs", "gauge", "jobs waiting for the compute thread (queue depth)"),
    "mean_batch": ("mean_batch", "gauge", "mean sessions per batched verification pass since start"),
    "refused": ("refused", "counter", "connections refused by the caps"),
    "reclaimed_handshakes": ("reclaimed_handshakes", "counter", "silent connections closed to free a handshake slot"),
    "sessions_served": ("sessions_served", "counter", "sessions ended"),
    "jobs": ("jobs", "counter", "compute jobs finished"),
    "compute_busy_s": ("compute_busy_seconds", "counter", "seconds the compute thread was busy"),
    "batches": ("batches", "counter", "batched verification passes"),
    "batched_jobs": ("batched_rounds", "counter", "verification rounds those passes carried"),
    "dropped_blocks": ("dropped_blocks", "counter", "pipelined blocks of an ended epoch, dropped unverified"),
    "verified_tokens": ("verified_tokens", "counter", "tokens the target decided (throughput: the rate of this counter)"),
    "trace_records": ("trace_records", "counter", "verify rounds written to trace shards (--record-traces)"),
    "trace_dropped": ("trace_records_dropped", "counter",
                      "verify rounds not recorded: the trace queue was full, or a shard could not be written"),
    "trace_shards": ("trace_shards", "counter", "trace shards written"),
    "trace_rotated": ("trace_shards_rotated", "counter", "oldest trace shards deleted to keep the bounds"),
    "trace_evicted": ("trace_buffers_evicted", "counter",
                      "trace buffers written early to keep a tenant's (or the whole) buffer memory bound"),
    "trace_buffered_bytes": ("trace_buffered_bytes", "gauge", "bytes of trace rounds buffered in memory"),
    "kv_budget_bytes": ("kv_budget_bytes", "gauge", "bytes of the KV pool (--kv-budget-gb, whole blocks)"),
    "kv_used_bytes": ("kv_used_bytes", "gauge", "bytes of the KV blocks sequences hold now"),
    "kv_peak_bytes": ("kv_peak_bytes", "gauge", "most bytes of KV blocks held at once since start"),
    "kv_free_blocks": ("kv_free_blocks", "gauge", "KV blocks neither held nor promised to an admitted decision"),
    "kv_sequences": ("kv_sequences", "gauge", "sequences with a cache in the KV pool"),
    "kv_refused": ("kv_refused", "counter", "KV reservations refused (a PREFILL or decision answered BUSY 'verifier full')"),
}

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
SESSION_BUCKETS = (1, 10, 30, 60, 300, 900, 1800, 3600, 4 * 3600, 24 * 3600)
RATE_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


class _StatusCollector:
    """The server's status() as gauges and counters, read when Prometheus scrapes."""

    def __init__(self, status, labels: dict):
        self.status, self.labels = status, labels

    def collect(self):
        status = self.status()
        names, values = list(self.labels), list(self.labels.values())
        for key, (name, kind, text) in STATUS_METRICS.items():
            family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(PREFIX + name, text, labels=names)
            family.add_metric(values, float(status[key]))
            yield family


class VerifierMetrics:
    """Every metric of one verifier; the server calls the ``on_*`` methods (any thread)."""

    def __init__(self, model_name: str, status=None, labels: dict | None = None):
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        self._tenants: set[str] = set()
        self._lock = threading.Lock()
        extra = dict(labels or {})  # e.g. {"replica": "0"} on Ray
        self._extra = extra
        base = ["model_name", *extra]
        tenant = [*base, "tenant"]
        reg = self.registry

        def counter(name, text, labels=tenant):
            return Counter(name, text, labels, registry=reg)

        self.drafts = counter("vllm:spec_decode_num_drafts", "speculative verification rounds with at least one draft token")
        self.draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "draft tokens verified")
        self.accepted_tokens = counter("vllm:spec_decode_num_accepted_tokens", "draft tokens the target accepted")
        self.accepted_per_pos = counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                        "draft tokens accepted at each draft position (0-based)",
                                        [*tenant, "position"])
        self.wisv_relaxed = counter(PREFIX + "wisv_relaxed_tokens",
                                    "LOSSY: draft tokens the WISV decision head accepted although the target "
                                    "disagreed (0 unless robots ask for verify_mode wisv)")
        self.exit_rounds = counter(PREFIX + "exit_rounds", "verification rounds that streamed early-exit guesses")
        self.exit_hits = counter(PREFIX + "exit_hits",
                                 "of those, rounds where an early exit guessed the verdict (the robot's pre-draft "
                                 "can hit)")
        self.decisions = counter(PREFIX + "decisions", "decisions (prompts) prefilled")

        def histogram(name, text, buckets):
            return Histogram(PREFIX + name, text, base, buckets=buckets, registry=reg)

        self.queue_wait = histogram("queue_wait_seconds", "a verification round's wait before its compute: behind "
                                    "the session's earlier blocks and other sessions' work", LATENCY_BUCKETS)
        self.round_compute = histogram("round_compute_seconds", "a verification round's own compute (its share of "
                                       "the batched pass, decoding q included)", LATENCY_BUCKETS)
        self.prefill = histogram("prefill_seconds", "a decision's prompt prefill (image and instruction)",
                                 LATENCY_BUCKETS)
        self.batch_size = histogram("batch_size", "rounds and AR steps carried by one batched forward pass",
                                    BATCH_BUCKETS)
        self.decision_tokens = histogram("decision_tokens", "tokens the target decided in one decision",
                                         TOKEN_BUCKETS)
        self.session_seconds = histogram("session_seconds", "how long a session stayed open", SESSION_BUCKETS)
        self.exit_hit_rate = histogram("exit_hit_rate", "per session: the share of its exit-streaming rounds an "
                                       "early exit guessed right", RATE_BUCKETS)
        if status is not None:
            reg.register(_StatusCollector(status, {"model_name": model_name, **extra}))
        # Series exist from the start at zero (a dashboard or an alert on rate() sees 0, not "no data")
        for h in (self.queue_wait, self.round_compute, self.prefill, self.batch_size, self.decision_tokens,
                  self.session_seconds, self.exit_hit_rate):
            h.labels(**self._labels())
        self._tenant_counters = (self.drafts, self.draft_tokens, self.accepted_tokens, self.wisv_relaxed,
                                 self.exit_rounds, self.exit_hits, self.decisions)

    # ------------------------------------------------------------------ labels

    def tenant(self, tenant_id: str | None) -> str:
        """The tenant's label value: bounded to MAX_TENANTS distinct values."""
        name = ANONYMOUS if tenant_id is None else tenant_id
        with self._lock:
            if name in self._tenants:
                return name
            if len(self._tenants) >= MAX_TENANTS:
                name = OTHER
                if name in self._tenants:
                    return name
            self._tenants.add(name)
        for c in self._tenant_counters:
            c.labels(**self._labels(name))
        return name

    def _labels(self, tenant: str | None = None) -> dict:
        base = {"model_name": self.model_name, **self._extra}
        return base if tenant is None else {**base, "tenant": tenant}

    # ------------------------------------------------------------------ events

    def on_round(self, tenant: str, *, drafted: int, accepted: int, queue_s: float, compute_s: float,
                 relaxed: int = 0, exits: bool = False, exit_hit: bool = False) -> None:
        """One verification round: ``drafted`` draft tokens, ``accepted`` of them accepted."""
        labels = self._labels(tenant)
        if drafted > 0:
            self.drafts.labels(**labels).inc()
            self.draft_tokens.labels(**labels).inc(drafted)
            self.accepted_tokens.labels(**labels).inc(accepted)
            for position in range(min(accepted, MAX_POSITION + 1)):
                self.accepted_per_pos.labels(**labels, position=str(position)).inc()
        if relaxed:
            self.wisv_relaxed.labels(**labels).inc(relaxed)
        if exits:
            self.exit_rounds.labels(**labels).inc()
            if exit_hit:
                self.exit_hits.labels(**labels).inc()
        base = self._labels()
        self.queue_wait.labels(**base).observe(max(0.0, queue_s))
        self.round_compute.labels(**base).observe(max(0.0, compute_s))

    def on_prefill(self, tenant: str, seconds: float) -> None:
        self.decisions.labels(**self._labels(tenant)).inc()
        self.prefill.labels(**self._labels()).observe(max(0.0, seconds))

    def on_batch(self, size: int) -> None:
        self.batch_size.labels(**self._labels()).observe(size)

    def on_decision_end(self, tokens: int) -> None:
        if tokens > 0:
            self.decision_tokens.labels(**self._labels()).observe(tokens)

    def on_session_end(self, seconds: float, exit_rounds: int, exit_hits: int) -> None:
        base = self._labels()
        self.session_seconds.labels(**base).observe(max(0.0, seconds))
        if exit_rounds:
            self.exit_hit_rate.labels(**base).observe(exit_hits / exit_rounds)

    def text(self) -> bytes:
        """The exposition (GET /metrics)."""
        return generate_latest(self.registry)
