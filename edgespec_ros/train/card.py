"""Measure the embedded models and write their model card (models/README.md + metrics.json).

Metrics (all on held-out scenarios/frames, never seen in training):
- closed-loop success of each model deciding alone at temperature 0 (`edgespec-sim eval`),
- action agreement with the expert on held-out frames,
- speculative decoding of draft against target at gamma = 4: per-token acceptance and tau,
  at temperature 0 and 1.
"""
from __future__ import annotations

import json
import os
from itertools import islice

from ..sim.dataset import generate_examples, iter_scenarios
from ..sim.evaluate import action_agreement, early_stop_counts, evaluate_closed_loop, failure_counts, run_episode
from ..robot.decoder import EdgeDecoder
from ..robot.settings import DEFAULTS, DecodeConfig
from ..cloud.local import LocalVerifier
from ..decoding.engines import load_model
from ..decoding.memory import PromptFormat
from ..decoding.metrics import RunSummary
from ..decoding.sampling import SamplingParams
from ..evaluation.policy import VLMPolicy


def sd_acceptance(draft_dir: str, target_dir: str, examples, gamma: int = DEFAULTS.gamma, temperature: float = 0.0,
                  seed: int = 0) -> dict:
    """Acceptance rate and tau of SD (draft vs target, in-process) over example frames."""
    from tqdm import tqdm
    draft, target = load_model(draft_dir), load_model(target_dir)
    decoder = EdgeDecoder(draft, LocalVerifier(target))
    summary = RunSummary(mode="sd", link="in-process", compute="native")
    for i, ex in enumerate(tqdm(examples, desc=f"SD gamma={gamma} T={temperature:g}", unit="dec")):
        cfg = DecodeConfig(mode="sd", gamma=gamma, max_new_tokens=DEFAULTS.max_new_tokens, seed=seed + i,
                           params=SamplingParams(temperature=temperature))
        summary.add(decoder.decide(ex.instruction, ex.image, cfg, history=getattr(ex, "history", ())).metrics)
    row = summary.row()
    return {"gamma": gamma, "temperature": temperature, "decisions": row["decisions"],
            "acceptance_rate": row["acceptance_rate"], "tau": row["tau"],
            "acceptance_per_position": row["acceptance_per_position"]}


def _read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def heldout_set(n_scenarios: int, n_frames: int, max_steps: int = 40, prompt: PromptFormat = PromptFormat(),
                expert=None):
    """The card's held-out scenarios and frames (deterministic: every worker builds the same); for
    a policy whose ``prompt`` shows memory, each frame carries the expert rollout's earlier decisions
    (the same frames and answers either way). ``expert``: the ``ExpertConfig`` whose answers label
    the frames (the one the model learnt from: :func:`trained_expert`; None: the default)."""
    from ..sim.expert import ExpertConfig
    scenarios = list(iter_scenarios("heldout", n_scenarios, max_steps=max_steps))
    frames = list(islice(generate_examples("heldout", n_scenarios, perturbations_per_step=0.5, prompt=prompt,
                                           expert_config=expert or ExpertConfig()), n_frames))
    return scenarios, frames


def trained_expert(model_dir: str):
    """The ``ExpertConfig`` whose answers the model in ``model_dir`` learnt (its training.json's
    "expert", written by ``edgespec-train --expert``; the default expert when it says none)."""
    from ..sim.expert import expert_from_overrides
    training = _read_json(os.path.join(model_dir, "training.json")) or {}
    return expert_from_overrides(training.get("expert"))


def _measure_part(models_dir: str, role: str, n_scenarios: int, n_frames: int, episodes: tuple[int, int],
                  n_sd: int, max_steps: int, n_demo: int = 0) -> dict:
    """One worker's share of a model's measurement: the closed-loop episodes ``episodes`` (a slice
    of the held-out scenarios, each also as the drafter node decides: :func:`resampled_outcomes`),
    plus, when ``n_frames``, the agreement on the held-out frames and (draft) SD against the target,
    and (target) the demo's scenario from ``n_demo`` jittered starts."""
    import torch
    torch.set_num_threads(1)  # small decode steps: one thread each is fastest
    policy = VLMPolicy(load_model(os.path.join(models_dir, role)))
    scenarios, frames = heldout_set(n_scenarios, n_frames, max_steps, PromptFormat(policy.memory, policy.belief),
                                    trained_expert(os.path.join(models_dir, role)))
    scenarios = scenarios[slice(*episodes)]
    loop = evaluate_closed_loop(policy, scenarios, desc=f"{role}: closed loop")
    part = {"episodes": loop["per_scenario"], "resampled": resampled_outcomes(policy, scenarios, loop)}
    if frames:
        agreement = action_agreement(policy, frames, desc=f"{role}: agreement")
        part.update(agreement=agreement["agreement"], frames=len(frames),
                    kind_direction_agreement=agreement["kind_direction_agreement"])
    if frames and role == "target" and n_demo:
        part["demo"] = demo_starts(policy, n=n_demo, max_steps=max_steps)
    if frames and role == "draft":
        d, t = os.path.join(models_dir, "draft"), os.path.join(models_dir, "target")
        part["sd"] = [sd_acceptance(d, t, frames[:n_sd], 4, 0.0), sd_acceptance(d, t, frames[:n_sd], 4, 1.0)]
    return part


DEMO_SCENARIO, DEMO_STARTS = "silver-bottle-distractor", 20


def demo_starts(policy, scenario: str = DEMO_SCENARIO, n: int = DEMO_STARTS, max_steps: int | None = None) -> dict:
    """The demo's default scenario (`make demo`) from ``n`` jittered starts (``jittered_starts``:
    up to 0.25 m and 15 degrees off), each decided greedily: how often a user watching the demo
    sees the robot reach the goal. ``max_steps`` caps the scenario's own decision limit."""
    from dataclasses import replace
    from ..sim.dataset import jittered_starts
    from ..sim.scenario import resolve_scenario
    base = resolve_scenario(scenario)
    if max_steps is not None:
        base = replace(base, max_steps=min(base.max_steps, max_steps))
    loop = evaluate_closed_loop(policy, jittered_starts(base, n), desc="demo starts")
    return {"scenario": scenario, "starts": n, "success_rate": loop["success_rate"],
            "collisions": sum(ep["collisions"] for ep in loop["per_scenario"])}


def resampled_outcomes(policy, scenarios, loop: dict) -> list[tuple[bool, int]]:
    """Each episode's (success, collisions) as the drafter node decides: the decision after an
    unparseable one or after a move that ran into something samples at its ``resample_temperature``.
    Episodes with neither are the same as greedy, so only the others run again (from the start)."""
    temperature = DEFAULTS.resample_temperature
    outcomes = []
    for scenario, ep in zip(scenarios, loop["per_scenario"]):
        again = run_episode(policy, scenario, temperature) if ep["unparseable"] or ep["collisions"] else None
        outcomes.append((again.success, again.collisions) if again else (ep["success"], ep["collisions"]))
    return outcomes


def examples_per_s(training: dict) -> str:
    """A model's training throughput for the card (measured, or from its steps and seconds)."""
    rate = training.get("examples_per_s")
    if rate is None and training.get("train_seconds"):
        rate = training.get("steps", 0) * training.get("batch_size", 0) / training["train_seconds"]
    return f"{rate:.0f}" if rate else "-"


def _summarise(parts: list[dict]) -> dict:
    """One model's card row from its workers' parts."""
    episodes = [ep for part in parts for ep in part["episodes"]]
    resampled = [outcome for part in parts for outcome in part["resampled"]]
    n = len(episodes)
    frames = next(part for part in parts if "agreement" in part)
    return {"episodes": n, "frames": frames["frames"],
            "success_rate": sum(ep["success"] for ep in episodes) / n,
            "mean_steps": sum(ep["steps"] for ep in episodes) / n,
            "collisions": sum(ep["collisions"] for ep in episodes),
            "unparseable_decisions": sum(ep["unparseable"] for ep in episodes),
            "action_agreement": frames["agreement"],
            "kind_direction_agreement": frames.get("kind_direction_agreement"),
            "demo": frames.get("demo"),
            "resample_temperature": DEFAULTS.resample_temperature,
            "resampled_episodes": sum(1 for ep in episodes if ep["unparseable"] or ep["collisions"]),
            "success_rate_resampled": sum(ok for ok, _ in resampled) / n,
            "collisions_resampled": sum(hits for _, hits in resampled),
            "failures": failure_counts(episodes), "early_stops": early_stop_counts(episodes)}


def measure(models_dir: str, n_scenarios: int = 120, n_frames: int = 600, draft_scenarios: int = 40,
            draft_frames: int = 200, n_sd: int = 40, workers: int = 2, max_steps: int = 40,
            n_demo: int = DEMO_STARTS) -> dict:
    """Every number of the card: the target on ``n_scenarios`` held-out episodes and ``n_frames``
    frames (40 episodes gave a standard error of ~7 points, and the first 40 of these 120 scored 15
    points above all 120), the draft on fewer (it is far below the target anyway), SD on the draft's
    first ``n_sd`` frames. ``workers`` > 1 spreads the work over processes, one thread each (the
    target's episodes in two halves, so that two workers finish together); the results do not
    depend on it. ``max_steps``: the decisions each closed-loop episode gets (the held-out
    scenarios' own limit by default). ``n_demo``: jittered starts of the demo's scenario (target)."""
    half = n_scenarios // 2
    jobs = [(models_dir, "target", n_scenarios, 0, (0, half), n_sd, max_steps, 0),
            (models_dir, "target", n_scenarios, n_frames, (half, n_scenarios), n_sd, max_steps, n_demo),
            (models_dir, "draft", draft_scenarios, draft_frames, (0, draft_scenarios), n_sd, max_steps, 0)]
    if workers > 1:
        from concurrent.futures import ProcessPoolExecutor
        from multiprocessing import get_context
        with ProcessPoolExecutor(min(workers, len(jobs)), mp_context=get_context("spawn")) as pool:
            parts = list(pool.map(_measure_part, *zip(*jobs)))
    else:
        parts = [_measure_part(*job) for job in jobs]
    return {"target": _summarise(parts[:2]), "draft": _summarise(parts[2:]), "sd": parts[2]["sd"],
            "expert_noise": expert_ceiling(n_scenarios, n_frames, trained_expert(os.path.join(models_dir, "target")))}


def _target_job(target_dir: str, kind: str, lo: int, hi: int, n_scenarios: int, n_frames: int,
                max_steps: int) -> dict:
    """One share of :func:`measure_targets`: closed-loop episodes ``lo:hi`` (greedy), agreement on
    frames ``lo:hi``, or the demo's jittered starts."""
    import torch
    torch.set_num_threads(1)
    policy = VLMPolicy(load_model(target_dir))
    if kind == "demo":
        return {"demo": demo_starts(policy, max_steps=max_steps)}
    scenarios, frames = heldout_set(n_scenarios, n_frames if kind == "frames" else 0, max_steps,
                                    PromptFormat(policy.memory, policy.belief), trained_expert(target_dir))
    if kind == "episodes":
        return {"episodes": evaluate_closed_loop(policy, scenarios[lo:hi], desc="closed loop")["per_scenario"]}
    agreement = action_agreement(policy, frames[lo:hi], desc="agreement")
    return {"frames": hi - lo, "agree": agreement["agreement"] * (hi - lo),
            "coarse": agreement["kind_direction_agreement"] * (hi - lo)}


def measure_targets(target_dirs: list[str], workers: int = 2, n_scenarios: int = 120, n_frames: int = 600,
                    max_steps: int = 40, episode_parts: int = 4, frame_parts: int = 2) -> dict:
    """The card's target figures (closed-loop success on ``n_scenarios`` held-out episodes,
    agreement on ``n_frames`` frames, the demo from 20 jittered starts, and why the failed
    episodes failed: ``sim.evaluate.failure_counts``) for several target directories at once,
    each cut into shares over ``workers`` processes: for comparing training runs on a machine
    with many cores. Greedy decisions only (the card's resampled figure is not repeated)."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    from ..sim.expert import expert_overrides
    cut = lambda n, k: [(n * i // k, n * (i + 1) // k) for i in range(k)]  # noqa: E731
    jobs = []
    for d in target_dirs:
        jobs += [(d, "episodes", lo, hi, n_scenarios, n_frames, max_steps) for lo, hi in cut(n_scenarios, episode_parts)]
        jobs += [(d, "frames", lo, hi, n_scenarios, n_frames, max_steps) for lo, hi in cut(n_frames, frame_parts)]
        jobs.append((d, "demo", 0, 0, n_scenarios, n_frames, max_steps))
    with ProcessPoolExecutor(max(1, workers), mp_context=get_context("spawn")) as pool:
        parts = list(pool.map(_target_job, *zip(*jobs)))
    out = {}
    for d in target_dirs:
        mine = [p for job, p in zip(jobs, parts) if job[0] == d]
        episodes = [ep for p in mine for ep in p.get("episodes", [])]
        frames = sum(p.get("frames", 0) for p in mine)
        n = len(episodes)
        out[d] = {"episodes": n, "frames": frames,
                  "success_rate": sum(ep["success"] for ep in episodes) / n,
                  "mean_steps": sum(ep["steps"] for ep in episodes) / n,
                  "collisions": sum(ep["collisions"] for ep in episodes),
                  "unparseable_decisions": sum(ep["unparseable"] for ep in episodes),
                  "action_agreement": sum(p.get("agree", 0) for p in mine) / frames,
                  "kind_direction_agreement": sum(p.get("coarse", 0) for p in mine) / frames,
                  "demo": next(p["demo"] for p in mine if "demo" in p),
                  "failures": failure_counts(episodes), "early_stops": early_stop_counts(episodes),
                  "per_scenario": episodes,
                  "expert": expert_overrides(trained_expert(d))}
    return out


def expert_ceiling(n_scenarios: int, n_frames: int, expert=None) -> dict:
    """The expert under perception noise on the card's held-out data (sim.robustness): what a
    learner that misjudges bearings and ranges by that much could reach on both bars (``expert``:
    the ``ExpertConfig`` the target learnt from; None: the default)."""
    from dataclasses import asdict

    from ..sim.expert import ExpertConfig
    from ..sim.robustness import DEFAULT_LEVELS, noise_report
    expert = expert or ExpertConfig()
    rows = noise_report(DEFAULT_LEVELS[1:], expert, n_scenarios, n_frames)
    return {"expert": asdict(expert),
            "levels": [{k: v for k, v in row.items() if k != "per_situation"} for row in rows]}


# what the card's "before and after" keeps of the pair it replaces (metrics["before"])
BEFORE_FIGURES = ("episodes", "success_rate", "collisions", "action_agreement", "kind_direction_agreement",
                  "demo", "failures")


def before_figures(models_dir: str, committed_dir: str) -> dict | None:
    """The figures a card compares its target with ("before"): the committed pair's card
    (``committed_dir``/metrics.json) as it stands when this card is measured, read before the card
    overwrites it (``make models`` writes into the committed directory). When that card describes
    this very target (its training.json: the committed pair measured again), the "before" it
    recorded itself; None when there is neither."""
    card = _read_json(os.path.join(committed_dir, "metrics.json"))
    if not card or "target" not in card.get("metrics", {}):
        return None
    previous = card.get("training", {}).get("target", {})
    if previous == _read_json(os.path.join(models_dir, "target", "training.json")):
        return card["metrics"].get("before")
    target = card["metrics"]["target"]
    label = (f"the target committed before this one ({previous['steps']:,} steps x {previous.get('batch_size')}, "
             f"final loss {previous['final_loss']:.3f})" if "steps" in previous and "final_loss" in previous
             else "the target committed before this one")
    return {"label": label, "target": {k: target[k] for k in BEFORE_FIGURES if k in target},
            "expert": previous.get("expert", {})}


def _where(early_stops: dict | None) -> str:
    """Where the early stops happened (``sim.evaluate.early_stop_counts``), e.g. " (1 at a look-alike,
    0 beyond 1.5 m, 1 within 1.5 m)"; "" where the card did not record it."""
    return f" ({', '.join(f'{n} {kind}' for kind, n in early_stops.items())})" if early_stops else ""


def before_after_lines(metrics: dict, expert: dict | None = None) -> list[str]:
    """The card's "before and after": the target against the one it replaces (``metrics["before"]``,
    :func:`before_figures`), on the same held-out episodes and frames; nothing when there is no
    "before" or it was measured on other episodes. ``expert``: the settings of the expert this
    target learnt from (training.json's "expert"): when the two targets learnt from different
    experts, each one's agreement is scored against its own, and the card says so."""
    before, after = (metrics.get("before") or {}).get("target"), metrics["target"]
    if not before or before.get("episodes") != after["episodes"]:
        return []

    def pair(key, fmt):
        a, b = before.get(key), after.get(key)
        return f"{fmt(a) if a is not None else 'not recorded'} -> {fmt(b) if b is not None else 'not recorded'}"

    def pct(x):
        return f"{100 * x:.1f}%"

    figures = [f"success {pair('success_rate', pct)}", f"exact agreement {pair('action_agreement', pct)}",
               f"kind + direction {pair('kind_direction_agreement', pct)}", f"collisions {pair('collisions', str)}",
               "demo " + pair("demo", lambda d: pct(d["success_rate"]))]
    kinds = []
    for kind, said in (("cycle", "cycles"), ("push", "pushes"), ("early stop", "early stops"), ("ran out", "ran out")):
        counts = [(x.get("failures") or {}).get(kind) for x in (before, after)]
        kinds.append(f"{said} {'/'.join('not recorded' if c is None else str(c) for c in counts)}")
    own = (" Each target's agreement is scored against the expert it learnt from (they differ)."
           if (metrics["before"].get("expert") or {}) != (expert or {}) else "")
    return ["", f"Before and after: {metrics['before']['label']} -> this one, on the same {after['episodes']} "
                f"held-out episodes: {', '.join(figures)}. Failed episodes, before/after: {', '.join(kinds)}.{own}"]


def write_card(models_dir: str, metrics: dict) -> str:
    training = {}
    for role in ("target", "draft"):
        path = os.path.join(models_dir, role, "training.json")
        if os.path.isfile(path):
            with open(path) as f:
                training[role] = json.load(f)
    with open(os.path.join(models_dir, "metrics.json"), "w") as f:
        json.dump({"metrics": metrics, "training": training}, f, indent=2)

    def pct(x):
        return f"{100 * x:.1f}%"

    lines = [
        "# Embedded default models: a draft/target Qwen2-VL pair trained in the simulated Go2 world",
        "",
        "Both are `Qwen2VLForConditionalGeneration` with the project's own byte-level BPE tokenizer",
        "(Qwen2-VL special tokens and chat template) and the Qwen2-VL image processor (112x112 frames",
        "-> 16 merged image tokens). The target plays Qwen2-VL-7B, the draft Qwen2-VL-2B: narrower,",
        "shallower and trained for less, so it agrees with the target only partly.",
        probe_line(training),
        *expert_lines(training.get("target", {})),
        *recipe_lines(training.get("target", {})),
        "",
        *reproduce_lines(models_dir),
        "Re-measure this card: `edgespec-train card`.",
        "",
        "| model | params | layers x width | vision depth x dim | steps x batch | train s | examples/s | final loss |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for role in ("target", "draft"):
        t = training.get(role, {})
        s = t.get("spec", {})
        lines.append(f"| {role} | {t.get('params', 0) / 1e6:.2f} M | {s.get('layers')} x {s.get('hidden')} | "
                     f"{s.get('vision_depth')} x {s.get('vision_dim')} | {t.get('steps')} x {t.get('batch_size')} | "
                     f"{t.get('train_seconds')} | {examples_per_s(t)} | {t.get('final_loss', float('nan')):.3f} |")
    t, d = metrics["target"], metrics["draft"]
    lines += ["", f"## Quality on held-out data (target: {t['episodes']} scenarios, {t['frames']} frames; "
                  f"draft: {d['episodes']}, {d['frames']})", "",
              "| model | closed-loop success (T=0) | mean steps | collisions | unparseable | action agreement with expert "
              "(exact) | kind + direction |",
              "|---|---|---|---|---|---|---|"]
    for role in ("target", "draft"):
        m = metrics[role]
        se = (m["success_rate"] * (1 - m["success_rate"]) / m["episodes"]) ** 0.5
        coarse = m.get("kind_direction_agreement")
        lines.append(f"| {role} | {pct(m['success_rate'])} ± {100 * se:.1f} | {m['mean_steps']:.1f} | {m['collisions']} | "
                     f"{m['unparseable_decisions']} | {pct(m['action_agreement'])} | "
                     f"{pct(coarse) if coarse is not None else '-'} |")
    demo = t.get("demo")
    if demo:
        lines += ["", f"The demo's scenario (`make demo`: {demo['scenario']}) from {demo['starts']} jittered starts "
                      f"(up to 0.25 m and 15 degrees off): the target reaches the goal in {pct(demo['success_rate'])} "
                      f"({demo['collisions']} collisions)."]
    if t.get("failures"):
        f = t["failures"]
        lines += ["", f"Why the target's failed episodes failed (`sim.evaluate.classify_failure`): "
                      f"{f['cycle']} left/right limit cycles, {f['push']} pushes into something (3+ collisions), "
                      f"{f['early stop']} early stops away from the goal{_where(t.get('early_stops'))}, "
                      f"{f['ran out']} ran out of decisions."]
    lines += before_after_lines(metrics, training.get("target", {}).get("expert"))
    if t.get("resampled_episodes"):
        n = t["resampled_episodes"]
        lines += ["", f"As the drafter node decides (after an unparseable decision or a move into something, the "
                      f"next one samples at temperature {t['resample_temperature']:g}; "
                      f"{n} target episode{'s' if n > 1 else ''} had such decisions and ran again): target "
                      f"closed-loop success {pct(t['success_rate_resampled'])}, "
                      f"{t.get('collisions_resampled', '?')} collisions."]
    lines += ["", *quality_bar_lines(metrics)]
    lines += ceiling_lines(metrics)
    lines += ["", "## Speculative decoding, draft vs target (gamma = 4, in-process)", "",
              "| temperature | decisions | per-token acceptance | tau (tokens/round) | acceptance by position |",
              "|---|---|---|---|---|"]
    for r in metrics["sd"]:
        per = ", ".join(f"{a:.2f}" for a in r["acceptance_per_position"])
        lines.append(f"| {r['temperature']:g} | {r['decisions']} | {r['acceptance_rate']:.3f} | {r['tau']:.2f} | {per} |")
    lines += ["", *draft_band_lines(metrics["sd"])]
    lines += distill_section(models_dir)
    lines += ["", "Closed loop: `edgespec-sim eval --model edgespec_ros/models/target --scenarios DIR --json OUT`",
              "(held-out scenarios: `edgespec-sim heldout --out DIR`).", ""]
    lines += exits_section(models_dir)
    path = os.path.join(models_dir, "README.md")
    with open(path, "w") as f:
        f.write("\n".join(lines))
    return path


# The project's bars for the embedded target: closed-loop
# success on the held-out episodes, agreement with the expert on what to do and which way
# (kind + direction) on the held-out frames, and the demo's scenario from jittered starts.
TARGET_SUCCESS_BAR = 0.85
TARGET_AGREEMENT_BAR = 0.92
DEMO_BAR = 0.95
# ... and for the draft: clearly weaker than the target, yet worth drafting with (per-token
# acceptance and tau at gamma = 4, at every measured temperature)
DRAFT_ACCEPTANCE_BAND = (0.5, 0.9)
# tau = 1 + the drafts accepted per round, about 1 + 4 x the acceptance rate at gamma 4: the ceiling
# follows the acceptance band's (4.6 at acceptance 0.9; a ceiling of 4 would cap acceptance at 0.75)
DRAFT_TAU_BAND = (2.0, 1 + 4 * DRAFT_ACCEPTANCE_BAND[1])


def distill_section(models_dir: str) -> list[str]:
    """The draft's distillation towards the target (draft/distill.json, ``edgespec-train distill``):
    the pair's size and cost ratio, held-out agreement and SD at gamma 2/4/6/8 before and after."""
    path = os.path.join(models_dir, "draft", "distill.json")
    if not os.path.isfile(path):
        return ["", "The draft was not distilled towards the target (no draft/distill.json)."]
    with open(path) as f:
        r = json.load(f)
    b, a = r["before"], r["after"]
    lines = ["", f"## The draft, distilled for its target ({r['config']['divergence'].upper()}, "
                 f"{r['steps']} steps, {r['seconds']:.0f} s)", "",
             f"Draft/target: {r['draft_params'] / 1e6:.2f} M / {r['target_params'] / 1e6:.2f} M parameters "
             f"({r['target_params'] / r['draft_params']:.1f}x), {r['draft_flops_per_token'] / 1e6:.2f} / "
             f"{r['target_flops_per_token'] / 1e6:.2f} MFLOP per text token "
             f"({r['target_flops_per_token'] / r['draft_flops_per_token']:.1f}x); the draft keeps its architecture.",
             f"Held-out agreement with the target along its greedy outputs ({a['positions']} positions of "
             f"{a['prompts']} frames): argmax match {b['greedy_match']:.3f} -> {a['greedy_match']:.3f}, "
             f"acceptance at T=1 (1 - TV) {b['accept_t1']:.3f} -> {a['accept_t1']:.3f}.", "",
             "| gamma | T | acceptance before -> after | tau before -> after | decisions |", "|---|---|---|---|---|"]
    for x, y in zip(r.get("sd_before", []), r.get("sd_after", [])):
        lines.append(f"| {y['gamma']} | {y['temperature']:g} | {x['acceptance_rate']:.3f} -> {y['acceptance_rate']:.3f} | "
                     f"{x['tau']:.2f} -> {y['tau']:.2f} | {y['decisions']} |")
    lines += ["", f"Command: `{r.get('command') or 'edgespec-train distill'}`."]
    return lines


def draft_band_lines(sd_rows: list[dict]) -> list[str]:
    """Whether SD's acceptance and tau (gamma 4) sit in the draft's bands, said plainly either way."""
    out = []
    for r in sd_rows:
        for name, value, (lo, hi) in (("acceptance", r["acceptance_rate"], DRAFT_ACCEPTANCE_BAND),
                                      ("tau", r["tau"], DRAFT_TAU_BAND)):
            if not lo <= value <= hi:
                out.append(f"{name} {value:.2f} at T={r['temperature']:g} outside {lo:g}-{hi:g}")
    band = (f"per-token acceptance {DRAFT_ACCEPTANCE_BAND[0]:g}-{DRAFT_ACCEPTANCE_BAND[1]:g} and tau "
            f"{DRAFT_TAU_BAND[0]:g}-{DRAFT_TAU_BAND[1]:g} at gamma 4")
    if not sd_rows:
        return [f"Not measured: the draft's bands ({band})."]
    if out:
        return [f"**Outside the draft's bands** ({band}): {'; '.join(out)}."]
    temps = " and ".join(f"T={r['temperature']:g}" for r in sd_rows)
    return [f"The draft is in its bands ({band}) at {temps}."]


def reproduce_lines(models_dir: str) -> list[str]:
    """How to reproduce the models, and how long the committed run took (from pipeline.json)."""
    path = os.path.join(models_dir, "pipeline.json")
    if not os.path.isfile(path):
        return ["Reproduce everything: `make models` (= `edgespec-train all`)."]
    with open(path) as f:
        run = json.load(f)
    stages = ", ".join(f"{k} {v / 60:.1f}" for k, v in run["stage_seconds"].items())
    cfg = run.get("config", {})
    lines = []
    if "train_scenarios" in cfg:
        closeups = cfg.get("closeups_per_scenario", 0)
        extra = (f", and {closeups:g} close-ups per scenario on average (frames right in front of an "
                 "object, look-alikes of the goal first)") if closeups else ""
        lines.append(f"Training data: the expert's rollouts in {cfg['train_scenarios']:,} random scenarios "
                     f"and jittered poses near them{extra}, all labelled by the expert.")
    if cfg.get("memory"):
        k = cfg["memory"]
        lines.append(f"Both models prompt with a policy memory (`decoding.memory`): the last {k} to {2 * k - 1} "
                     "decisions and how each ended, as earlier chat turns; the data rollouts executed a typical "
                     f"mistake in {cfg.get('memory_noise', 0):.0%} of decisions (a reversed turn, a large move into "
                     f"what is ahead) and {cfg.get('memory_dropout', 0):.0%} of frames were shown without their memory.")
        if cfg.get("belief"):
            lines.append("The memory's last turn carries the search belief (`control.belief`): how far the robot "
                         "has turned left and right and moved since the command, and where the goal was last seen "
                         "relative to the current heading, dead-reckoned from the decisions and their outcomes.")
    command = run.get("command", "edgespec-train all")
    how = ("`make models` (= `edgespec-train all`)" if command == "edgespec-train all"
           else f"`{command}`")
    earlier, resumed = run.get("stages_done_earlier") or [], run.get("resumed_models") or []
    if earlier or resumed:  # carried on with --resume: the times are the last piece's
        took = (f"the committed run was carried on in pieces (`--resume`); its last piece took "
                f"{run['total_seconds_before_card'] / 60:.1f} min")
        pieces = ([f"{', '.join(earlier)} ran in earlier pieces"] if earlier else []) + (
            [f"the {' and '.join(resumed)}'s train s in the table count{'s' if len(resumed) == 1 else ''} "
             "every piece"] if resumed else [])
        after = f"; {'; '.join(pieces)}"
    else:
        took, after = f"the committed run took {run['total_seconds_before_card'] / 60:.1f} min", ""
    return lines + [f"Reproduce everything: {how}; {took} before this card on a 2-core CPU with "
                    f"{run['threads']} torch threads (minutes per stage: {stages}; the card itself takes a "
                    f"few more{after})."] + ([run["note"]] if run.get("note") else [])


def recipe_lines(target: dict) -> list[str]:
    """The target's optional stages (training.json): continued training, a pretrained vision
    tower, DAgger rounds."""
    lines = []
    if target.get("init"):
        lines.append(f"The target continued from the trained target in `{target['init']}` (every weight; "
                     f"{target.get('steps')} more steps, a fresh schedule peaking at learning rate {target.get('lr', 0):g}).")
    if target.get("vision_init"):
        lines.append(f"The target started from a vision tower pretrained alone (`edgespec-train vision`), "
                     f"{target.get('vision_mode')} in the language stage.")
    for r in target.get("dagger") or []:
        lines.append(f"DAgger round {r['round']}: the target, part-trained, drove in training scenarios "
                     f"{r['scenarios'][0]}-{r['scenarios'][1] - 1} (success {100 * r['success_rate']:.0f}%); "
                     f"the {r['frames']} states it visited joined its data with the expert's answers.")
    return lines


def expert_lines(target: dict) -> list[str]:
    """What the card says of the expert the target learnt from (training.json's "expert"), when
    it is not the default one: its labels are what the agreement figures are scored against."""
    if not target.get("expert"):
        return []
    said = ", ".join(f"{k}={','.join(map(str, v)) if isinstance(v, list) else v}" for k, v in sorted(target["expert"].items()))
    return [f"The expert whose answers the models learnt, and whose answers the agreement figures below are scored "
            f"against, is not the default one: {said} (`sim.expert.ExpertConfig`; `edgespec-train --expert`)."]


def probe_line(training: dict) -> str:
    """How the models were taught to look (training.json of each role)."""
    said = []
    for role in ("target", "draft"):
        weight = training.get(role, {}).get("aux_weight", 0)
        said.append(f"the {role} trained with the perception and goal probes (`AuxPerception`, weight {weight:g}; "
                    "thrown away after training)" if weight else f"the {role} trained on the answer text alone")
    return f"The prompt puts the instruction before the image; {said[0]}, {said[1]}."


def quality_bar_lines(metrics: dict) -> list[str]:
    """Whether the target meets the project's bars, said plainly either way."""
    t = metrics["target"]
    checks = [("closed-loop success", t["success_rate"], TARGET_SUCCESS_BAR),
              ("kind + direction agreement", t.get("kind_direction_agreement"), TARGET_AGREEMENT_BAR),
              ("demo success from jittered starts", (t.get("demo") or {}).get("success_rate"), DEMO_BAR)]
    missed = [f"{name} {value:.1%} < {bar:.0%}" for name, value, bar in checks if value is not None and value < bar]
    unmeasured = [name for name, value, _ in checks if value is None]
    bars = ", ".join(f">= {bar:.0%} {name}" for name, _, bar in checks)
    if not missed:
        lines = [f"The target meets the project's bars ({bars})."]
    else:
        lines = [f"**Below the project's bars:** {'; '.join(missed)}. Decisions follow the target, so the demo "
                 "and the closed-loop test fail when it does."]
    if unmeasured:
        lines.append(f"Not measured: {', '.join(unmeasured)}.")
    return lines


def ceiling_lines(metrics: dict) -> list[str]:
    """The expert-under-noise table (metrics["expert_noise"]), if measured."""
    ceiling = metrics.get("expert_noise")
    if not ceiling:
        return []
    lines = ["", "How far a camera-bound learner can follow the expert: the expert itself deciding from "
             "slightly wrong geometry (bearing, range and wall distance off by Gaussian noise of this size; "
             "one pixel is 0.8 degrees, and half a pixel of floor is a ~5% range error at 2 m), on the same "
             "held-out frames and episodes (`edgespec-sim expert-noise`):", "",
             "| perception noise (sd) | agreement with the exact expert | closed-loop success | collisions |",
             "|---|---|---|---|"]
    for row in ceiling["levels"]:
        lines.append(f"| {row['label']} | {100 * row['agreement']:.1f}% | {100 * row['success_rate']:.1f}% | "
                     f"{row['collisions']} |")
    return lines


def exits_section(models_dir: str) -> list[str]:
    """The target's early-exit adapters (FSD), from target/exits/exits.json, if trained."""
    path = os.path.join(models_dir, "target", "exits", "exits.json")
    if not os.path.isfile(path):
        return []
    from .exits import format_exit_table
    with open(path) as f:
        meta = json.load(f)
    m = meta["metrics"]
    return ["## Early-exit adapters on the target (FSD)", "",
            f"Layers {meta['layers']}, rank {meta['rank']}, {meta['params']:,} parameters; token match with the "
            f"final layer and mean confidence on {m['heldout_examples']} held-out frames (details and plot: "
            "`target/exits/README.md`; reproduce: `edgespec-train exits`):", "",
            format_exit_table(m["per_exit"], m.get("untrained_per_exit")), ""]
