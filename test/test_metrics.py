"""The verifier's Prometheus metrics (cloud.metrics): vLLM's speculative-decoding counters agree with
what the robot measured, the histograms see every round, prefill, batch, decision and session,
tenant labels are bounded and never carry a token, and every metric the Grafana dashboard in
docs/ queries exists."""
from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from edgespec_ros.cloud import metrics as metrics_module
from edgespec_ros.cloud.metrics import MAX_TENANTS, OTHER, VerifierMetrics
from edgespec_ros.cloud.server import VerifierServer
from edgespec_ros.cloud.thread import ServerThread
from edgespec_ros.robot.decoder import EdgeDecoder
from edgespec_ros.robot.settings import DecodeConfig
from edgespec_ros.wire.client import RemoteVerifier

from wire_helpers import INSTRUCTIONS, make_pair, server_copy

DASHBOARD = Path(__file__).resolve().parents[1] / "docs" / "grafana.json"
TOKEN = "s3cret-robot-token"


@pytest.fixture(scope="module")
def pair():
    return make_pair()


def scrape(st: ServerThread) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{st.port}/metrics", timeout=10).read().decode()


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of an exposition."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def total(found: dict, name: str, **labels) -> float:
    return sum(v for (n, lab), v in found.items() if n == name and all(dict(lab).get(k) == x for k, x in labels.items()))


@pytest.fixture(scope="module")
def served(pair):
    """Three SD decisions and one AR decision from one robot, then the scrape."""
    st = ServerThread(VerifierServer(server_copy(pair.target), token=[TOKEN], status_interval_s=0))
    with st:
        with RemoteVerifier(st.url, fingerprint=pair.draft.fingerprint(), vocab_size=pair.draft.vocab_size,
                            token=TOKEN) as rv:
            edge = EdgeDecoder(pair.draft, rv)
            decisions = [edge.decide(INSTRUCTIONS[i % len(INSTRUCTIONS)], pair.image,
                                     DecodeConfig(mode="sd", gamma=4, max_new_tokens=24, seed=i)) for i in range(3)]
            ar = edge.decide(INSTRUCTIONS[0], pair.image, DecodeConfig(mode="ar", max_new_tokens=6))
            before_close = scrape(st)
            edge.close()
        # the session ends when the robot hangs up: its length and last decision are counted then
        deadline = time.monotonic() + 10
        while st.server.status()["sessions_served"] < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        after_close = scrape(st)
        tenant = st.server.tenant_ids[0]
        model = st.server.model_name
    return decisions, ar, samples(before_close), samples(after_close), after_close, tenant, model


def test_spec_decode_counters_match_what_the_robot_measured(served):
    decisions, _ar, found, _after, _text, tenant, model = served
    labels = {"tenant": tenant, "model_name": model}
    rounds = sum(d.metrics.rounds for d in decisions)
    drafted = sum(d.metrics.drafted for d in decisions)
    accepted = sum(d.metrics.accepted for d in decisions)
    assert rounds > 0 and 0 < accepted <= drafted
    assert total(found, "vllm:spec_decode_num_drafts_total", **labels) == rounds
    assert total(found, "vllm:spec_decode_num_draft_tokens_total", **labels) == drafted
    assert total(found, "vllm:spec_decode_num_accepted_tokens_total", **labels) == accepted
    per_pos = [sum(d.metrics.accepted_per_position[i] if i < len(d.metrics.accepted_per_position) else 0
                   for d in decisions) for i in range(8)]
    for i, want in enumerate(per_pos):
        assert total(found, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(i), **labels) == want
    assert total(found, "edgespec_verifier_decisions_total", **labels) == 4  # 3 SD + 1 AR prefills


def test_histograms_see_every_round_prefill_batch_and_decision(served):
    decisions, ar, found, after, _text, _tenant, _model = served
    rounds = sum(d.metrics.rounds for d in decisions)
    assert total(found, "edgespec_verifier_queue_wait_seconds_count") == rounds
    assert total(found, "edgespec_verifier_round_compute_seconds_count") == rounds
    assert total(found, "edgespec_verifier_round_compute_seconds_sum") > 0
    assert total(found, "edgespec_verifier_prefill_seconds_count") == 4
    # every verify round and AR step went through a batched pass (one robot: batches of 1)
    assert total(found, "edgespec_verifier_batch_size_count") == rounds + ar.metrics.tokens
    assert total(found, "edgespec_verifier_batch_size_sum") == rounds + ar.metrics.tokens
    # a decision is counted when the next one starts, the last when the session ends
    assert total(found, "edgespec_verifier_decision_tokens_count") == 3
    assert total(after, "edgespec_verifier_decision_tokens_count") == 4
    # the target's tokens: the robot's, and a last bonus token it may drop at max_new_tokens
    decided = total(after, "edgespec_verifier_decision_tokens_sum")
    assert decided == total(after, "edgespec_verifier_verified_tokens_total")
    assert 0 <= decided - (sum(d.metrics.tokens for d in decisions) + ar.metrics.tokens) <= len(decisions)
    assert total(after, "edgespec_verifier_session_seconds_count") == 1
    assert total(after, "edgespec_verifier_sessions") == 0
    assert total(after, "edgespec_verifier_sessions_served_total") == 1


def test_tenants_are_labelled_by_hash_and_bounded():
    _ = VerifierMetrics("m")
    m = VerifierMetrics("target-7b", status=None)
    names = [m.tenant(f"tenant{i:03d}") for i in range(MAX_TENANTS + 10)]
    assert len(set(names)) == MAX_TENANTS + 1 and names[-1] == OTHER  # the first MAX_TENANTS, then "other"
    assert m.tenant("tenant000") == "tenant000"  # a known tenant keeps its label
    for name in names:
        m.on_round(name, drafted=4, accepted=2, queue_s=0.0, compute_s=0.01)
    found = samples(m.text().decode())
    series = {dict(lab)["tenant"] for (n, lab) in found if n == "vllm:spec_decode_num_drafts_total"}
    assert len(series) == MAX_TENANTS + 1
    assert total(found, "vllm:spec_decode_num_drafts_total", tenant=OTHER) == 10


def test_the_token_never_appears_in_the_metrics(served):
    text = served[4]
    assert TOKEN not in text
    assert f'tenant="{served[5]}"' in text


def test_exit_guesses_counted_per_round_and_per_session():
    m = VerifierMetrics("t")
    for hit in (True, True, False, True):
        m.on_round("a", drafted=3, accepted=1, queue_s=0, compute_s=0, exits=True, exit_hit=hit)
    m.on_round("a", drafted=3, accepted=3, queue_s=0, compute_s=0, relaxed=2)
    m.on_session_end(12.0, exit_rounds=4, exit_hits=3)
    found = samples(m.text().decode())
    assert total(found, "edgespec_verifier_exit_rounds_total") == 4
    assert total(found, "edgespec_verifier_exit_hits_total") == 3
    assert total(found, "edgespec_verifier_exit_hit_rate_sum") == 0.75
    assert total(found, "edgespec_verifier_wisv_relaxed_tokens_total") == 2
    assert total(found, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position="2") == 1


def queried_metrics(dashboard: dict) -> set[str]:
    """The metric names in every panel query and template variable of a Grafana dashboard."""
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["query"] for v in dashboard["templating"]["list"] if v.get("type") == "query"]
    names = set()
    for expr in exprs:
        expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
        expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges
        expr = re.sub(r'"[^"]*"', "", expr)
        for word in re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr):
            if word.startswith(("vllm:", "edgespec_")):
                names.add(word)
    return names


def test_every_metric_the_dashboard_queries_exists(served):
    dashboard = json.loads(DASHBOARD.read_text())
    queried = queried_metrics(dashboard)
    assert len(queried) >= 15, queried
    exposed = {name for name, _ in served[3]}
    missing = sorted(queried - exposed)
    assert not missing, f"docs/grafana.json queries metrics the verifier does not expose: {missing}"
    # and the dashboard covers what an operator watches first
    for family in ("vllm:spec_decode_num_drafts_total", "edgespec_verifier_queue_wait_seconds_bucket",
                   "edgespec_verifier_batch_size_bucket", "edgespec_verifier_exit_hits_total"):
        assert family in queried


def test_the_dashboard_check_catches_a_missing_metric(served):
    dashboard = json.loads(DASHBOARD.read_text())
    dashboard["panels"][0]["targets"][0]["expr"] = "rate(vllm:spec_decode_num_rejected_tokens_total[5m])"
    assert "vllm:spec_decode_num_rejected_tokens_total" in queried_metrics(dashboard) - {n for n, _ in served[3]}


def test_status_metrics_keep_their_names():
    m = VerifierMetrics("t", status=lambda: dict.fromkeys(metrics_module.STATUS_METRICS, 2), labels={"replica": "r1"})
    text = m.text().decode()
    assert 'edgespec_verifier_sessions{model_name="t",replica="r1"} 2.0' in text
    assert 'edgespec_verifier_refused_total{model_name="t",replica="r1"} 2.0' in text
    assert "# TYPE edgespec_verifier_queued_jobs gauge" in text
