"""Scale-out on Ray Serve: two replicas of the verifier behind one websocket
endpoint, on a local Ray instance on this machine's CPUs. One Ray cluster for the whole module
(its start-up is kept out of the other test modules).

Robots are real EdgeDecoders with RemoteVerifiers: their sessions spread over both replicas, each
decision is token-identical to the same decision against an in-process verifier, and when the
replica holding a robot's session is killed mid-decision, that decision fails with a lost link
(the drafter's fault stop; nothing of the decision is committed) and the robot's next decision
lands on a live replica with the right output.
"""
from __future__ import annotations

import socket
import threading
import time

import pytest

ray = pytest.importorskip("ray", reason="the fleet extra (ray[serve]) is not installed")

from edgespec_ros.models import resolve_models  # noqa: E402
from edgespec_ros.bench.runner import bench_prompts  # noqa: E402
from edgespec_ros.robot.decoder import EdgeDecoder  # noqa: E402
from edgespec_ros.robot.settings import DecodeConfig, DrafterSettings  # noqa: E402
from edgespec_ros.decoding.engines import load_model  # noqa: E402
from edgespec_ros.cloud.local import LocalVerifier  # noqa: E402
from edgespec_ros.robot.drafter import DrafterCore, Frame  # noqa: E402
from edgespec_ros.wire.client import LinkLostError, RemoteVerifier, VerifierError  # noqa: E402
from edgespec_ros.cloud.config import build_parser  # noqa: E402

pytestmark = pytest.mark.slow  # end-to-end: `make test` runs it, `make test-fast` does not


CFG = DecodeConfig(mode="sd", gamma=4, max_new_tokens=24)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def models():
    pair = resolve_models(None, None)
    return load_model(pair.draft_path), load_model(pair.target_path)


@pytest.fixture(scope="module")
def fleet():
    from ray import serve
    from edgespec_ros.cloud import ray_serve
    args = build_parser().parse_args(["--replicas", "2", "--port", str(_free_port()), "--status-interval", "0",
                                      "--cpus-per-replica", "1"])
    started = time.perf_counter()
    url = ray_serve.start(args, [], local_cpus=2)
    print(f"Ray Serve with 2 replicas up in {time.perf_counter() - started:.1f} s at {url}")
    try:
        yield url
    finally:
        ray_serve.stop_edge()
        serve.shutdown()
        ray.shutdown()


def _robot(models, url) -> EdgeDecoder:
    draft, _ = models
    return EdgeDecoder(draft, RemoteVerifier(url, fingerprint=draft.fingerprint(), vocab_size=draft.vocab_size,
                                             timeout_s=60.0, connect_timeout_s=30.0, client_name="ray-test",
                                             prompt_format=draft.prompt_format))


def _reference(models, prompts) -> list[list[int]]:
    draft, target = models
    local = EdgeDecoder(draft, LocalVerifier(target))
    return [local.decide(instruction, image, CFG).tokens for instruction, image in prompts]


def _replica(robot: EdgeDecoder) -> str:
    return robot.verifier.welcome.server.rsplit(" ", 1)[-1]


def _kill_replica(tag: str) -> None:
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith("SERVE_REPLICA::") and a["name"].endswith(tag)]
    assert len(names) == 1, names
    ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)


def test_sessions_spread_over_replicas_and_match_a_single_verifier(models, fleet):
    prompts = bench_prompts(4, seed=3)
    expected = _reference(models, prompts)
    robots = [_robot(models, fleet) for _ in prompts]
    for robot in robots:  # one at a time: each new connection is routed by the replicas' open sessions
        robot.verifier.connect()
    replicas = [_replica(r) for r in robots]
    assert len(set(replicas)) == 2 and all(replicas.count(t) == 2 for t in set(replicas)), replicas
    got: list = [None] * len(robots)

    def run(i):
        got[i] = robots[i].decide(*prompts[i], CFG).tokens
    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(robots))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    # /metrics answers from the replica the request lands on, its series labelled with that replica
    import urllib.error
    import urllib.request
    http = fleet.replace("ws://", "http://").rstrip("/")
    try:
        text = urllib.request.urlopen(http + "/metrics", timeout=30).read().decode()
    except urllib.error.HTTPError as exc:
        raise AssertionError(exc.read().decode()) from None
    for robot in robots:
        robot.verifier.close()
    assert got == expected
    drafts = [line for line in text.splitlines() if line.startswith("vllm:spec_decode_num_drafts_total{")]
    assert drafts and all('replica="' in line for line in drafts), text[:2000]
    assert sum(float(line.split()[-1]) for line in drafts) > 0


def test_a_replica_killed_mid_decision_faults_the_robot_and_the_next_decision_lands_on_a_live_one(models, fleet):
    (instruction, image), = bench_prompts(1, seed=7)
    expected, = _reference(models, [(instruction, image)])
    robot = _robot(models, fleet)
    robot.verifier.connect()
    doomed = _replica(robot)
    submit = robot.verifier.submit
    killed = []

    def kill_then_submit(block):  # the PREFILL is on the replica: the decision is under way
        if not killed:
            _kill_replica(doomed)
            killed.append(time.perf_counter())
        return submit(block)
    robot.verifier.submit = kill_then_submit
    core = DrafterCore(robot, DrafterSettings(mode="sd", gamma=4, deadline_s=60.0, max_new_tokens=24,
                                              wait_for_motion=False), time.monotonic_ns)
    core.set_command(instruction)
    core.set_frame(Frame(image, time.monotonic_ns(), "cam"))
    published = []
    ticket = core.begin()
    assert ticket is not None
    outcome = core.run(ticket, on_partial=published.append)
    assert killed, "the decision never reached its first block"
    # The robot's fault stop: a stop with the lost link named, and no partial text acted on.
    assert outcome is not None and outcome.action == "stop" and outcome.fault, outcome
    assert "verifier" in outcome.fault.lower() or "link" in outcome.fault.lower(), outcome.fault
    assert core.stats.faults == 1
    robot.verifier.submit = submit
    # Next decision: a fresh connection, routed to the live replica (Serve replaces the dead one
    # meanwhile; until it is up, the router sends new sessions to the other).
    for attempt in range(3):
        try:
            robot.verifier.connect()
            break
        except (LinkLostError, VerifierError):
            time.sleep(2.0)
    assert _replica(robot) != doomed
    print(f"replica {doomed} killed mid-decision: {outcome.fault}; reconnected to {_replica(robot)} "
          f"{time.perf_counter() - killed[0]:.1f} s after the kill (attempt {attempt + 1})")
    assert robot.decide(instruction, image, CFG).tokens == expected
    robot.verifier.close()
