"""The verifier's counters in the Prometheus text format (GET /metrics; the Ray front end too)."""
from __future__ import annotations

# status() key -> Prometheus metric name (prefixed edgespec_verifier_), type, help.
METRICS = {
    "sessions": ("sessions", "gauge", "open sessions (HELLO accepted)"),
    "tenants": ("tenants", "gauge", "auth tokens with open sessions"),
    "handshaking": ("handshaking", "gauge", "connections that have not sent an accepted HELLO"),
    "queued_jobs": ("queued_jobs", "gauge", "jobs waiting for the compute thread (queue depth)"),
    "mean_batch": ("mean_batch", "gauge", "mean sessions per batched verification pass since start"),
    "refused": ("refused_total", "counter", "connections refused by the caps"),
    "reclaimed_handshakes": ("reclaimed_handshakes_total", "counter",
                             "silent connections closed to free a handshake slot"),
    "sessions_served": ("sessions_served_total", "counter", "sessions ended"),
    "jobs": ("jobs_total", "counter", "compute jobs finished"),
    "compute_busy_s": ("compute_busy_seconds_total", "counter", "seconds the compute thread was busy"),
    "batches": ("batches_total", "counter", "batched verification passes"),
    "batched_jobs": ("batched_rounds_total", "counter", "verification rounds those passes carried"),
    "dropped_blocks": ("dropped_blocks_total", "counter", "pipelined blocks of an ended epoch, dropped unverified"),
    "verified_tokens": ("verified_tokens_total", "counter",
                        "tokens the target decided (throughput: the rate of this counter)"),
    "trace_records": ("trace_records_total", "counter", "verify rounds written to trace shards (--record-traces)"),
    "trace_dropped": ("trace_records_dropped_total", "counter",
                      "verify rounds not recorded: the trace queue was full, or a shard could not be written"),
    "trace_shards": ("trace_shards_total", "counter", "trace shards written"),
    "trace_rotated": ("trace_shards_rotated_total", "counter", "oldest trace shards deleted to keep the bounds"),
}


def metrics_text(status: dict, labels: dict | None = None) -> str:
    """status() in the Prometheus text exposition format (GET /metrics)."""
    tag = "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else ""
    lines = []
    for key, (name, kind, text) in METRICS.items():
        name = f"edgespec_verifier_{name}"
        lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}", f"{name}{tag} {float(status[key]):g}"]
    return "\n".join(lines) + "\n"
