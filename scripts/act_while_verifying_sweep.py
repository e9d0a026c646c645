"""Acting while verifying, measured in the linked closed loop (EMULATED latencies): off vs overlap vs
speculative over held-out scenarios, one JSON per regime in docs/results/act-while-verifying-*.json.

    edgespec-sim heldout --out /tmp/HO30 --n 30
    PYTHONPATH=. python scripts/act_while_verifying_sweep.py --scenarios /tmp/HO30 --out docs/results

Regimes (all latencies stated, EMULATED): ``h200-wifi-poor``: the measured H200 slots profile's cloud
AR (``sim.link_loop.STATED_MS_PER_TOKEN``, 27.3 ms/token, what mode auto decides as there) + the
wifi-poor round trip; ``h200-cellular``: the same over cellular's round trip; ``go2-paper``: go2-paper's cloud and link with the Orin drafting at 72 ms/token,
per-token figures derived from docs/robot.md's measured per-decision medians (cloud AR 12.2 s,
auto 7.4 s a decision) over docs/results/modes.json's 30.25 tokens a decision, less the round trip.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

from tqdm import tqdm

from edgespec_ros.control.chaining import MAX_DECISION_AGE_S
from edgespec_ros.control.link_health import LinkHealth
from edgespec_ros.decoding.compute import GO2_PAPER, get_robot
from edgespec_ros.decoding.engines import load_model
from edgespec_ros.evaluation.policy import VLMPolicy
from edgespec_ros.models import default_model_path
from edgespec_ros.robot.settings import DEFAULTS
from edgespec_ros.sim.act_loop import ActWhileVerifying
from edgespec_ros.sim.commands import load_scenarios
from edgespec_ros.sim.link_loop import (STATED_MS_PER_TOKEN, STATED_PREFILL_MS, DraftLatency, StatedLatency,
                                        run_linked_episode, summarize)
from edgespec_ros.wire.link import OutageSchedule, get_profile

TOKENS_A_DECISION = 242 / 8  # docs/results/modes.json: 242 tokens over 8 decisions (the go2-paper rows)
GO2_RTT_S = get_profile("go2-paper").rtt_s
GO2_MS = {mode: (decision_s - GO2_RTT_S) / TOKENS_A_DECISION * 1e3 for mode, decision_s in (("ar", 12.2), ("auto", 7.4))}

# regime -> (link, deadline_s, rows: (label, cloud mode, ms/token, act_while_verifying, max_decision_age_s))
SHIPPED_AGE = MAX_DECISION_AGE_S  # the navigator's
REGIMES = {
    "h200-wifi-poor": ("wifi-poor", DEFAULTS.deadline_s, [
        ("off", "auto (= cloud AR)", STATED_MS_PER_TOKEN, "off", SHIPPED_AGE),
        ("overlap", "auto (= cloud AR)", STATED_MS_PER_TOKEN, "overlap", SHIPPED_AGE),
        ("speculative", "auto (= cloud AR)", STATED_MS_PER_TOKEN, "speculative", SHIPPED_AGE),
    ]),
    # overlap_min_progress: how far into the running motion the next decision's frame may be captured
    "h200-min-progress": ("wifi-poor", DEFAULTS.deadline_s, [
        ("off", "auto (= cloud AR)", STATED_MS_PER_TOKEN, "off", SHIPPED_AGE),
        *((f"overlap, overlap_min_progress {mp:g}", "auto (= cloud AR)", STATED_MS_PER_TOKEN, "overlap", SHIPPED_AGE, mp)
          for mp in (0.0, 0.5, 0.6, 0.75, 0.9)),
    ]),
    "h200-cellular": ("cellular", DEFAULTS.deadline_s, [
        ("off", "auto (= cloud AR)", STATED_MS_PER_TOKEN, "off", SHIPPED_AGE),
        ("overlap", "auto (= cloud AR)", STATED_MS_PER_TOKEN, "overlap", SHIPPED_AGE),
    ]),
    # a go2-paper decision (7.4 s with auto) outlasts the navigator's 5 s decision age: every decision
    # begun during a motion would be dropped, so the rows at 15 s say what overlap could do there.
    # (No "ar speculative": an ar decision drafts nothing for the drafter to move on.)
    "go2-paper": ("go2-paper", 30.0, [
        ("ar off", "ar", GO2_MS["ar"], "off", SHIPPED_AGE),
        ("auto off", "auto", GO2_MS["auto"], "off", SHIPPED_AGE),
        ("auto overlap", "auto", GO2_MS["auto"], "overlap", SHIPPED_AGE),
        ("auto overlap, max_decision_age_s 15", "auto", GO2_MS["auto"], "overlap", 15.0),
        ("auto speculative, max_decision_age_s 15", "auto", GO2_MS["auto"], "speculative", 15.0),
    ]),
}

# confirm: the decision made during a motion drafts the one made where it ends (sim.act_loop.ConfirmingRun).
# A hinted decision's cost (StatedLatency.hinted): the cloud's prefill of the new frame, then per round a
# round trip and one pass of up to 16 tokens. The H200's: its measured profile's prefill (87.7 ms,
# STATED_PREFILL_MS) and a pass at the stated per-token figure (27.3 ms; the profile measured 22-25 ms for
# 1-16 tokens); go2-paper's: its profile's 620 ms pass and 620 ms prefill. Rows for both clouds, with the
# shipped settings.
# The tokens after a spent hint are cloud AR (robot.rounds.HintedStrategy): the H200's stated figure
# (auto decides as cloud AR there), go2-paper's cloud AR.
HINT_COSTS = {"wifi-poor": (STATED_MS_PER_TOKEN, STATED_PREFILL_MS, STATED_MS_PER_TOKEN),
              "cellular": (STATED_MS_PER_TOKEN, STATED_PREFILL_MS, STATED_MS_PER_TOKEN),
              "go2-paper": (GO2_PAPER.verify_s * 1e3, GO2_PAPER.prefill_s * 1e3, GO2_MS["ar"])}
REGIMES |= {
    "h200-confirm": ("wifi-poor", DEFAULTS.deadline_s, [
        ("off", "auto (= cloud AR)", STATED_MS_PER_TOKEN, "off", SHIPPED_AGE),
        ("confirm", "auto (= cloud AR)", STATED_MS_PER_TOKEN, "confirm", SHIPPED_AGE),
    ]),
    "h200-cellular-confirm": ("cellular", DEFAULTS.deadline_s, [
        ("off", "auto (= cloud AR)", STATED_MS_PER_TOKEN, "off", SHIPPED_AGE),
        ("confirm", "auto (= cloud AR)", STATED_MS_PER_TOKEN, "confirm", SHIPPED_AGE),
    ]),
    # WHAT-IF: confirm's ceiling, every decision made during a motion saying exactly what the one made
    # where it ends says (PerfectHint): what a policy whose words do not change with the frame would get
    "h200-confirm-ceiling": ("wifi-poor", DEFAULTS.deadline_s, [
        ("off", "auto (= cloud AR)", STATED_MS_PER_TOKEN, "off", SHIPPED_AGE),
        ("confirm, WHAT-IF every hint the decision", "auto (= cloud AR)", STATED_MS_PER_TOKEN, "confirm", SHIPPED_AGE),
    ]),
    "go2-paper-confirm": ("go2-paper", 30.0, [
        ("ar off", "ar", GO2_MS["ar"], "off", SHIPPED_AGE),
        ("auto off", "auto", GO2_MS["auto"], "off", SHIPPED_AGE),
        ("auto confirm", "auto", GO2_MS["auto"], "confirm", SHIPPED_AGE),
    ]),
}

class PerfectHint(StatedLatency):
    """WHAT-IF: a hinted decision priced as if its hint were the decision itself (the confirm ceiling)."""

    @property
    def label(self) -> str:
        return super().label + "; WHAT-IF: every hint equal to its decision"

    def hinted(self, tokens, hint, block=16):
        return super().hinted(tokens, tokens, block)


# What a user would pick instead (LITERATURE, EMULATED through the link): cloud-only vLLM, its all-in
# ms per token on each link from the regime map's engine rows (docs/results/regimes.json: the published
# batch-1 step, the measured H200 prefill, the same link proxy), built as the H200 rows are (that
# per-token figure plus one round trip). Blocking rows: the decisions are the committed target's.
ENGINES = {"literature-vllm-h100-llama31-8b-bs1": "vLLM (LITERATURE)",
           "literature-vllm-h100-llama31-8b-eagle3-bs1": "vLLM + EAGLE-3 (LITERATURE)"}


def engine_rows(links=("wifi-poor", "go2-paper")) -> list[tuple[str, str, float]]:
    """(label, link, ms per token) of each production engine on each link, from the regime map."""
    rows = json.loads(Path("docs/results/regimes.json").read_text())["rows"]
    found = {}
    for r in rows:
        if r.get("source") == "LITERATURE" and r.get("cloud_name") in ENGINES and r["link"] in links:
            found[(ENGINES[r["cloud_name"]], r["link"])] = r["ms_per_token"]
    return [(f"{name} off, {link}", link, ms) for (name, link), ms in sorted(found.items(), key=lambda kv: kv[0][::-1])]


class Memo:
    """A policy's decisions remembered by what it saw (the frame's bytes, the prompt's history, and for
    a sampled decision its temperature and seed): each is a function of them, so a row that renders
    the same frames as another decides for free."""

    def __init__(self, policy):
        self.policy, self.memory, self.belief = policy, policy.memory, policy.belief
        self._seen: dict = {}

    def decide(self, image, instruction, temperature=0.0, seed=0, history=()):
        key = (hashlib.sha1(image.tobytes()).hexdigest(), instruction, repr(tuple(history)),
               temperature, seed if temperature else 0)
        if key not in self._seen:
            self._seen[key] = self.policy.decide(image, instruction, temperature, seed, history=history)
        return self._seen[key]


class Replay:
    """The blocking run's decisions of one scenario in order, whatever it sees: what a policy robust to
    frames captured mid-motion (and to the 'executing' word) would decide, for the clock's share alone."""

    memory, belief = 0, False

    def __init__(self, outs):
        self.outs, self.calls = outs, 0

    def decide(self, image, instruction, history=()):
        out = self.outs[min(self.calls, len(self.outs) - 1)]
        self.calls += 1
        return out


class Recorder:
    """A policy that keeps what it answered (the blocking run's decisions, for :class:`Replay`)."""

    def __init__(self, policy):
        self.policy, self.memory, self.belief, self.log = policy, policy.memory, policy.belief, []

    def decide(self, image, instruction, history=()):
        out = self.policy.decide(image, instruction, history=history)
        self.log.append(out)
        return out


NO_AGE = 1e9  # the replay's rows: no frame-age rule (a dropped decision would shift the replay)
CLOCK_ONLY = [("h200-wifi-poor", "wifi-poor", DEFAULTS.deadline_s, STATED_MS_PER_TOKEN),
              ("go2-paper auto", "go2-paper", 30.0, GO2_MS["auto"]), ("go2-paper ar", "go2-paper", 30.0, GO2_MS["ar"])]


def write_report(report: dict, path: Path, width: int, pauses: bool = False) -> None:
    """Write a regime's report and print a line a row (the clock-only and engines regimes)."""
    path.write_text(json.dumps(report, indent=1))
    print(f"wrote {path}")
    for label, row in report["rows"].items():
        print(f"  {label:<{width}} success {row['success_rate']:.1%} collisions {row['collisions']:>3} median "
              f"{row['time_median_s']:.1f} p90 {row['time_p90_s']:.1f} waiting {row['waiting_ratio']:.1%}"
              + (f" pauses {row['pauses_per_episode']:.1f}" if pauses else ""))


def clock_only(target, scenarios, health, commit, out_dir, target_dir: str, tag: str = "") -> None:
    """Overlap's share of the clock alone: each scenario's blocking decisions replayed under overlap."""
    report = {"command": "PYTHONPATH=. python scripts/act_while_verifying_sweep.py --scenarios HO30 --regimes "
                         "clock-only" + (f" --target={target_dir} --tag={tag}" if tag else ""), "commit": commit,
              "models": {"target": target_dir},
              "note": "EMULATED latencies; the target's decisions of the blocking (off) run replayed in order under "
                      "overlap, whatever the frame: a policy robust to frames captured mid-motion, the same "
                      "trajectories as off, no frame-age rule (max_decision_age_s 1e9): the clock's share alone",
              "rows": {}}
    recorder = Recorder(target)
    bar = tqdm(total=len(CLOCK_ONLY) * len(scenarios) * 2, desc="clock-only", unit="ep")
    for label, link_name, deadline_s, ms in CLOCK_ONLY:
        profile = get_profile(link_name)
        latency = StatedLatency(ms, profile.rtt_s)
        kw = dict(link=OutageSchedule(profile, 0), on_link_loss=DEFAULTS.on_link_loss, health=health,
                  decision_latency=latency, deadline_s=deadline_s)
        for mode in ("off", "overlap"):
            episodes = []
            for i, s in enumerate(scenarios):
                if mode == "off":
                    recorder.log = []
                    episodes.append(run_linked_episode(recorder, s, **kw))
                    logs[i] = list(recorder.log)
                else:
                    episodes.append(run_linked_episode(Replay(logs[i]), s, acting=ActWhileVerifying(
                        "overlap", NO_AGE, DEFAULTS.provisional_margin_s), **kw))
                bar.update(1)
            report["rows"][f"{label} {mode}"] = summarize(episodes) | {"latency_model": latency.label}
    bar.close()
    write_report(report, Path(out_dir) / f"act-while-verifying-clock-only{tag}.json", width=30,
                 pauses=True)


logs: dict[int, list] = {}


def engines(target, scenarios, health, commit, out_dir, target_dir: str, tag: str = "") -> None:
    """Time to goal with cloud-only production engines (blocking; LITERATURE per-token figures)."""
    report = {"command": "PYTHONPATH=. python scripts/act_while_verifying_sweep.py --scenarios HO30 --regimes engines"
                         + (f" --target={target_dir} --tag={tag}" if tag else ""),
              "commit": commit, "models": {"target": target_dir},
              "note": "EMULATED latencies from LITERATURE figures: each engine's all-in ms per token on the link "
                      "(docs/results/regimes.json's engine rows: the published batch-1 step, the measured H200 "
                      "prefill, the link proxy) plus one round trip a decision, as the H200 rows are built: the "
                      "link's round trip is charged twice (conservative against the engine); "
                      "blocking (act_while_verifying off); the committed target's decisions",
              "rows": {}}
    rows = engine_rows()
    bar = tqdm(total=len(rows) * len(scenarios), desc="engines", unit="ep")
    for label, link_name, ms in rows:
        profile = get_profile(link_name)
        latency = StatedLatency(ms, profile.rtt_s)
        episodes = []
        for s in scenarios:
            episodes.append(run_linked_episode(target, s, link=OutageSchedule(profile, 0),
                                               on_link_loss=DEFAULTS.on_link_loss, health=health,
                                               decision_latency=latency,
                                               deadline_s=30.0 if link_name == "go2-paper" else DEFAULTS.deadline_s))
            bar.update(1)
        report["rows"][label] = summarize(episodes) | {"link": link_name, "ms_per_token": ms,
                                                       "latency_model": latency.label, "source": "LITERATURE"}
    bar.close()
    write_report(report, Path(out_dir) / f"act-while-verifying-engines{tag}.json", width=40)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenarios", required=True)
    parser.add_argument("--out", default="docs/results")
    parser.add_argument("--regimes", nargs="+", choices=[*REGIMES, "clock-only", "engines"],
                        default=[*REGIMES, "clock-only", "engines"])
    parser.add_argument("--target", default=None, help="the target model dir (default: the committed pair's)")
    parser.add_argument("--draft", default=None, help="the draft model dir (default: the committed pair's)")
    parser.add_argument("--tag", default="", help="appended to the results' file names (another pair's rows)")
    parser.add_argument("--resample-temperature", type=float, default=0.0,
                        help="the regimes' rows: the decision after an unparseable or blocked one samples at this "
                             "temperature, as the drafter node's (its default: 0.7); 0, greedy throughout (the "
                             "committed rows)")
    args = parser.parse_args(argv)
    scenarios = load_scenarios(args.scenarios)
    target_dir, draft_dir = args.target or default_model_path("target"), args.draft or default_model_path("draft")
    target = Memo(VLMPolicy(load_model(target_dir), max_new_tokens=DEFAULTS.max_new_tokens))
    draft = Memo(VLMPolicy(load_model(draft_dir), max_new_tokens=DEFAULTS.max_new_tokens))
    draft_latency = DraftLatency(get_robot("orin-paper"))
    health = LinkHealth(DEFAULTS.link_loss_faults, DEFAULTS.reconnect_backoff_s, DEFAULTS.reconnect_backoff_max_s)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    if "clock-only" in args.regimes:
        clock_only(target, scenarios, health, commit, args.out, target_dir, args.tag)
    for regime in args.regimes:
        if regime == "clock-only":
            continue
        if regime == "engines":
            engines(target, scenarios, health, commit, args.out, target_dir, args.tag)
            continue
        link_name, deadline_s, rows = REGIMES[regime]
        profile = get_profile(link_name)
        report = {"command": "PYTHONPATH=. python scripts/act_while_verifying_sweep.py --scenarios HO30 "
                             f"--regimes {regime}" + "".join(f" --{k}={v}" for k, v in (("target", args.target),
                                                             ("draft", args.draft), ("tag", args.tag),
                                                             ("resample-temperature", args.resample_temperature)) if v)
                             + "  (HO30: edgespec-sim heldout --out HO30 --n 30)",
                  "commit": commit, "models": {"target": target_dir, "draft": draft_dir},
                  "scenarios": f"{len(scenarios)} held-out ({args.scenarios})", "link": profile.describe(),
                  "deadline_s": deadline_s, "draft_latency_model": draft_latency.label,
                  "note": "EMULATED latencies (stated per token + one round trip), simulated clock; " + (
                      "the committed pair was never trained on frames captured mid-motion nor on the 'executing' word"
                      if args.target is None else "the models given (--target, --draft)") + (
                      f"; the decision after an unparseable or blocked one sampled at temperature "
                      f"{args.resample_temperature:g}, as the drafter node's" if args.resample_temperature
                      else "; greedy throughout"),
                  "rows": {}}
        if regime == "go2-paper":
            report["per_token_derivation"] = (
                f"(median decision s - rtt {GO2_RTT_S:g} s) / {TOKENS_A_DECISION:g} tokens a decision: ar 12.2 s -> "
                f"{GO2_MS['ar']:.1f} ms/token, auto 7.4 s -> {GO2_MS['auto']:.1f} ms/token (docs/robot.md "
                "'The task's time per mode', docs/results/modes.json)")
        bar = tqdm(total=len(rows) * len(scenarios), desc=regime, unit="ep")
        for label, mode, ms, acting_mode, age, *min_progress in rows:
            bar.set_postfix_str(label)
            pass_ms, prefill_ms, tail_ms = HINT_COSTS[link_name]
            kind = PerfectHint if regime.endswith("-ceiling") else StatedLatency
            latency = kind(ms, profile.rtt_s, pass_ms=pass_ms, prefill_ms=prefill_ms, tail_ms_per_token=tail_ms)
            acting = ActWhileVerifying(acting_mode, age, DEFAULTS.provisional_margin_s,
                                       min_progress=min_progress[0] if min_progress else 0.0)
            started, episodes = time.time(), []
            for s in scenarios:
                episodes.append(run_linked_episode(
                    target, s, link=OutageSchedule(profile, 0), on_link_loss=DEFAULTS.on_link_loss, health=health,
                    decision_latency=latency, deadline_s=deadline_s, draft_policy=draft, draft_latency=draft_latency,
                    acting=acting, resample_temperature=args.resample_temperature))
                bar.update(1)
            report["rows"][label] = summarize(episodes) | {
                "cloud_mode": mode, "act_while_verifying": acting_mode, "max_decision_age_s": age,
                "provisional_margin_s": DEFAULTS.provisional_margin_s, "latency_model": latency.label,
                "overlap_min_progress": acting.min_progress,
                "acting_model": acting.label, "wall_s": round(time.time() - started, 1),
                "per_scenario": [e.to_dict(with_records=False) for e in episodes]}
        bar.close()
        path = Path(args.out) / f"act-while-verifying-{regime}{args.tag}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1))
        print(f"wrote {path}")
        for label, row in report["rows"].items():
            p = row["provisional"]
            print(f"  {label:<38} success {row['success_rate']:.1%} collisions {row['collisions']:>3} "
                  f"median {row['time_median_s']:.1f} p90 {row['time_p90_s']:.1f} waiting {row['waiting_ratio']:.1%} "
                  f"pauses {row['pauses_per_episode']:.1f} dropped {row['dropped']} provisional {p['taken']}/"
                  f"{p['confirmed']}/{p['reverted']} ({p['reverted_m']:.2f} m, {p['reverted_deg']:.0f} deg)"
                  + (f" hinted {row['hinted']}" if "hinted" in row else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
