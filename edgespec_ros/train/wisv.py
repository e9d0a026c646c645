"""Training the WISV decision head (paper 002, section V-B): CSI-aware budgeted relabeling of
mismatch traces and the balanced BCE fit. The trace collection over simulator episodes builds
on these; the head is used by ``decoding.wisv``.

Relabeling (Eq. 28-31): a mismatch's task label c_i is 1 when accepting the draft token there
(and decoding on greedily) changes the parsed action. Critical mismatches spread a smoothed
importance s_i = max_j c_j * decay^|i - j| to their neighbours. Under a sampled channel state of
quality q in (0, 1], each critical mismatch keeps its "repair" label with probability
sigma((s_i - lambda(q)) / kappa), where the Lagrange multiplier lambda(q) = lambda_max * (1 - q)
grows as the channel worsens (a smaller repair budget); harmless mismatches are never promoted
(one-way relabeling). So the labels are the task's own on a perfect link and relax, critical
ones first by importance, as rounds get expensive. The task label itself comes in three kinds
(``LABELS``): each mismatch alone, sequential (the kept mismatches stay kept), and executed (a
changed action is critical only when executing it does worse in the simulator).
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from ..decoding.memory import PromptFormat
from ..evaluation.replay import GREEDY_NEW_TOKENS
from ..robot.settings import DEFAULTS


@dataclass(frozen=True)
class RelabelConfig:
    decay: float = 0.5        # smoothed importance: a critical mismatch's weight on its neighbours per position
    lambda_max: float = 1.2   # the multiplier on the worst channel (q -> 0): relaxes even s_i = 1 often
    kappa: float = 0.15       # smoothness of the Bernoulli policy (entropy regularisation)

    def __post_init__(self):
        if not 0 <= self.decay < 1:
            raise ValueError(f"decay must be in [0, 1), got {self.decay}")
        if self.lambda_max < 0 or self.kappa <= 0:
            raise ValueError("lambda_max must be >= 0 and kappa > 0")


def smoothed_importance(critical: list[bool], decay: float) -> list[float]:
    """s_i = max_j c_j * decay^|i - j| over one episode's ordered mismatches (Eq. 28)."""
    marks = [j for j, c in enumerate(critical) if c]
    return [max((decay ** abs(i - j) for j in marks), default=0.0) for i in range(len(critical))]


def repair_probability(importance: float, critical: bool, quality: float, cfg: RelabelConfig = RelabelConfig()) -> float:
    """P(label = repair) for one mismatch under channel quality q (Eq. 31); 0 for a harmless one."""
    if not critical:
        return 0.0
    if not 0 < quality <= 1:
        raise ValueError(f"channel quality must be in (0, 1], got {quality}")
    lam = cfg.lambda_max * (1.0 - quality)
    return 1.0 / (1.0 + math.exp(-(importance - lam) / cfg.kappa))


def relabel(critical: list[bool], quality: float, rng: random.Random, cfg: RelabelConfig = RelabelConfig()) -> list[int]:
    """Sampled repair (1) / skip (0) labels of one episode's mismatches under channel quality q."""
    importance = smoothed_importance(critical, cfg.decay)
    return [int(rng.random() < repair_probability(s, c, quality, cfg)) for s, c in zip(importance, critical)]


# --------------------------------------------------------------------------------------------------
# Trace collection (Stage 1): SD rounds of the draft against the target on simulator frames

@dataclass
class MismatchTrace:
    """One mismatch of a greedy SD round: the two hidden states the head reads, its task label."""

    h_draft: torch.Tensor     # [draft hidden]: the drafter's final-norm state that produced the draft token
    h_target: torch.Tensor    # [target hidden]: the target's state at the same position (its argmax differs)
    critical: bool            # accepting the draft token (then decoding on greedily) changes the parsed action
    position: int             # token index after the prompt
    tokens: torch.Tensor | None = None  # [2 d]: the target's embeddings of the draft token and of its own
    context: tuple = ()       # the tokens before the mismatch (committed, then the round's drafts before it)
    draft_token: int = -1     # the draft token judged there
    action_changed: bool | None = None  # the parsed action changed (None: not recorded); with executed-
    #                                     outcome labels a changed action may still be harmless


LABELS = ("alone", "sequential", "executed")


def episode_traces(draft, target, instruction: str, image, gamma: int = DEFAULTS.gamma,
                   max_new_tokens: int = GREEDY_NEW_TOKENS, policy=None, labels: str = "alone",
                   history=(), judge=None) -> list[MismatchTrace]:
    """Speculative rounds of one decision, recording every unprotected mismatch of every round (in
    the round's own context: positions after an earlier mismatch see the draft tokens before them,
    as WISV would) with its task label: critical when keeping the draft token there and decoding
    on greedily gives another action than the target alone. ``policy`` (an ``SdRound -> accepted``
    choice, e.g. ``wisv_choice``) decides the rounds; None is greedy SD. Under a WISV policy the
    prefix holds the mismatches kept before (the states the head meets when it decides: DAgger).

    ``labels``: "alone" judges each mismatch with everything before it as greedy SD (or the policy)
    left it; "sequential" follows the oracle instead: each mismatch judged harmless is
    kept and stays kept while the next is judged, and a round stops at the first critical one,
    so every label is taken in the context a head that keeps what is harmless would meet (the
    decision keeps several mismatches, not one). The oracle's decision ends in the target's action.
    "executed" is "sequential" where a changed action is critical only when its *execution* is
    worse: ``judge`` (``sim.expert_rollout.ExecutedOutcome`` of the frame's world state) says whether the
    changed action, executed and carried on by the expert, touches nothing more and reaches the
    goal in no more decisions than the target's (then the oracle's decision may end in that action).
    A ``judge`` given with the other labels relabels the same way.
    ``history``: the earlier decisions a policy with memory is shown (``decoding.memory``)."""
    if labels not in LABELS:
        raise ValueError(f"labels must be one of {LABELS}, got {labels!r}")
    if labels == "executed" and judge is None:
        raise ValueError("executed-outcome labels need the frame's world state: give a judge "
                         "(sim.expert_rollout.ExecutedOutcome)")
    sequential = labels in ("sequential", "executed")
    if sequential and policy is not None:
        raise ValueError(f"{labels} labels follow the oracle: give no policy")
    from ..cloud.target import target_generate
    from ..robot.settings import DecodeConfig
    from ..decoding.sampling import SamplingParams
    from ..evaluation.replay import action_of_tokens, greedy_choice, greedy_continue_batch, prompt_pair, replay_rounds
    from ..decoding.wisv import token_pair_features
    eos = target.eos_token_ids
    d_inputs, t_inputs = prompt_pair(draft, target, instruction, image, history)

    def action(tokens):
        return action_of_tokens(target, tokens)

    def critical(candidate, reference) -> tuple[bool, bool]:
        """(the parsed action changed, the mismatch is critical)"""
        changed = candidate != reference
        return changed, changed and not (judge is not None and judge.as_good(candidate, reference))

    def continue_greedily(tokens, budget):
        if budget <= 0 or (tokens and tokens[-1] in eos):
            return []
        return target_generate(target, t_inputs.extended(tokens),
                               DecodeConfig(mode="ar", max_new_tokens=budget, params=SamplingParams(temperature=0.0)))

    traces = []
    if policy is None and labels == "alone":
        # Greedy SD is lossless: its own output is the target's reference, so the replay records
        # each mismatch with a copy of the target's cache there, and every counterfactual of the
        # decision is then decoded in one batch (no reference decode, larger batches).
        found = []

        def note(r):
            for i in r.mismatches:
                if i not in r.protected:
                    prefix = r.committed + r.draft_ids[:i + 1]
                    fork = None if prefix[-1] in eos else r.continuation_from(i)
                    found.append((MismatchTrace(r.d_rows[i].clone(), r.t_rows[i].clone(), False, len(r.committed) + i,
                                                token_pair_features(target, [r.draft_ids[i]], [r.argmax[i]])[0],
                                                tuple(prefix[:-1]), int(r.draft_ids[i])), fork))
            return greedy_choice(r)

        reference, _ = replay_rounds(draft, target, d_inputs, t_inputs, note, gamma, max_new_tokens)
        reference_action = action(reference)
        open_ = [(t, fork) for t, fork in found if fork is not None]
        rests = greedy_continue_batch([fork for _, fork in open_],
                                      [max_new_tokens - len(t.context) - 1 for t, _ in open_], eos)
        rest_of = {id(t): rest for (t, _), rest in zip(open_, rests)}
        for t, _ in found:
            t.action_changed, t.critical = critical(action(list(t.context) + [t.draft_token] + rest_of.get(id(t), [])),
                                                    reference_action)
            traces.append(t)
        return traces

    reference = continue_greedily([], max_new_tokens)
    reference_action = action(reference)

    def record(r):
        judged = [i for i in r.mismatches if i not in r.protected]
        if sequential:  # the oracle stops at the first protected mismatch
            first = next((i for i in r.mismatches if i in r.protected), len(r.draft_ids))
            judged = [i for i in judged if i < first]
        # every judged mismatch's counterfactual continuation, in one batch (copies of the target's cache)
        prefixes = {i: r.committed + r.draft_ids[:i + 1] for i in judged}
        open_ = [i for i in judged if prefixes[i][-1] not in eos]
        rests = dict(zip(open_, greedy_continue_batch([r.continuation_from(i) for i in open_],
                                                      [max_new_tokens - len(prefixes[i]) for i in open_], eos)))
        for i in r.mismatches:
            if i in r.protected:
                if sequential:
                    return i  # the oracle rejects a protected mismatch, as WISV does
                continue
            prefix = prefixes[i]
            changed, bad = critical(action(prefix + rests.get(i, [])), reference_action)
            traces.append(MismatchTrace(r.d_rows[i].clone(), r.t_rows[i].clone(), bad, len(r.committed) + i,
                                        token_pair_features(target, [r.draft_ids[i]], [r.argmax[i]])[0],
                                        tuple(prefix[:-1]), int(r.draft_ids[i]), changed))
            if sequential and bad:
                return i  # the first critical mismatch is rejected: the round ends there
        if sequential:
            return len(r.draft_ids)  # every mismatch harmless: all kept
        return greedy_choice(r) if policy is None else policy(r)

    tokens, _ = replay_rounds(draft, target, d_inputs, t_inputs, record, gamma, max_new_tokens)
    if sequential and critical(action(tokens), reference_action)[1]:
        # each kept mismatch was harmless in its context, so this needs a numerical near-tie (a
        # batched continuation's argmax against the replay's): the episode's labels are dropped
        import warnings
        warnings.warn("wisv traces: the oracle's decision ended worse than the target's action (a numerical near-tie); "
                      "this episode's labels are dropped", RuntimeWarning, stacklevel=2)
        return []
    return traces


def collect_traces(draft, target, examples, gamma: int = DEFAULTS.gamma, progress=None, policies=None, workers: int = 1,
                   model_dirs: tuple[str, str] | None = None, labels: str = "alone",
                   executed: bool = False) -> list[list[MismatchTrace]]:
    """One episode of traces per example (``sim.dataset`` Example: image, instruction); policies
    (one per example, or None: greedy SD) decide the rounds. ``executed`` (implied by labels
    "executed") judges changed actions by their executed outcome, so each example must be a
    :class:`SimFrame` (its scenario and pose). With ``workers`` > 1 and
    ``model_dirs`` (draft, target) the episodes run in that many processes, one torch thread
    each (small decode steps: one thread per episode beats two on one), and ``policies`` must be
    ``dagger_policy_specs`` (plain data a process can receive). Results do not depend on it."""
    if workers > 1 and model_dirs is not None and len(examples) > 1:
        from concurrent.futures import ProcessPoolExecutor
        from multiprocessing import get_context
        specs = policies if policies is not None else [None] * len(examples)
        episodes = []
        with ProcessPoolExecutor(workers, mp_context=get_context("spawn"), initializer=_trace_worker_init,
                                 initargs=model_dirs) as pool:
            for episode in pool.map(_trace_job, examples, [gamma] * len(examples), specs, [labels] * len(examples),
                                    [executed] * len(examples)):
                episodes.append([_tensors_as(t, torch.from_numpy) for t in episode])
                if progress is not None:
                    progress(1)
        return episodes
    episodes = []
    for i, example in enumerate(examples):
        policy = None if policies is None else _policy(policies[i], target)
        episodes.append(episode_traces(draft, target, example.instruction, example.image, gamma, policy=policy,
                                       labels=labels, history=getattr(example, "history", ()),
                                       judge=_judge(example, labels, executed)))
        if progress is not None:
            progress(1)
    return episodes


_WORKER: dict = {}  # a trace process's models and heads


def _trace_worker_init(draft_dir: str, target_dir: str) -> None:
    import torch
    from ..decoding.engines import load_model
    torch.set_num_threads(1)
    _WORKER.update(draft=load_model(draft_dir), target=load_model(target_dir), heads={})


def _trace_job(example, gamma: int, spec, labels: str = "alone", executed: bool = False):
    """One episode in a trace process; its tensors go back as numpy arrays (tensors sent between
    processes would each hold a file descriptor in the parent for as long as the traces live)."""
    target = _WORKER["target"]
    traces = episode_traces(_WORKER["draft"], target, example.instruction, example.image, gamma,
                            policy=_policy(spec, target, _WORKER["heads"]), labels=labels,
                            history=getattr(example, "history", ()), judge=_judge(example, labels, executed))
    return [_tensors_as(t, lambda x: x.numpy()) for t in traces]


class SimFrame(NamedTuple):
    """A traced decision with the world state it was seen in (what executed-outcome labels need)."""

    image: np.ndarray
    instruction: str
    history: tuple
    scenario: object  # sim.scenario.Scenario
    pose: object      # sim.scenario.Pose


def sim_frames(split: str, n_scenarios: int, prompt: PromptFormat = PromptFormat()) -> list[SimFrame]:
    """The frames ``generate_examples(split, n_scenarios, prompt=prompt)`` gives, with their state."""
    from ..sim.dataset import expert_frames
    return [SimFrame(f.view.rgb, f.scenario.instruction, f.history, f.scenario, f.pose)
            for f in expert_frames(split, n_scenarios, prompt=prompt)]


def _judge(example, labels: str, executed: bool):
    if not (executed or labels == "executed"):
        return None
    if not hasattr(example, "scenario"):
        raise ValueError("executed-outcome labels need each frame's world state: give SimFrames (sim_frames)")
    from ..sim.expert_rollout import ExecutedOutcome
    return ExecutedOutcome(example.scenario, example.pose)


def _tensors_as(trace: MismatchTrace, convert) -> MismatchTrace:
    from dataclasses import replace
    return replace(trace, h_draft=convert(trace.h_draft), h_target=convert(trace.h_target),
                   tokens=None if trace.tokens is None else convert(trace.tokens))


def _policy(spec, target, heads: dict | None = None):
    """A round choice from a ``dagger_policy_specs`` entry (head dir, CSI, threshold); a callable
    passes through; None is greedy SD."""
    if spec is None or callable(spec):
        return spec
    from ..decoding.wisv import Csi, DecisionHead
    from ..evaluation.replay import wisv_choice
    head_dir, csi, threshold = spec
    heads = {} if heads is None else heads  # a process's cache: its heads live as long as the pass
    if head_dir not in heads:
        heads[head_dir] = DecisionHead.load(head_dir)[0]
    return wisv_choice(heads[head_dir], Csi.from_wire(csi), threshold, target)


DAGGER_THRESHOLDS = (0.05, 0.1, 0.2, 0.3)


def dagger_policy_specs(head_dir: str, n: int, rng: random.Random) -> list[tuple]:
    """The first head's WISV choices, one per example, each under a sampled channel state and a
    threshold from DAGGER_THRESHOLDS (head dir, CSI on the wire, threshold): the trajectories the
    second pass collects traces on (``collect_traces`` makes them choices, in any process)."""
    return [(head_dir, sample_csi(rng).to_wire(), rng.choice(DAGGER_THRESHOLDS)) for _ in range(n)]


def sample_csi(rng: random.Random):
    """A channel state to relabel under: rates log-uniform 0.5..1000 Mbit/s (downlink 1-4x the
    uplink), RTT log-uniform 1..300 ms, no loss half the time, else up to 5%."""
    from ..decoding.wisv import Csi
    up = 10 ** rng.uniform(math.log10(0.5e6), math.log10(1e9))
    rtt = 10 ** rng.uniform(math.log10(1e-3), math.log10(0.3))
    return Csi(up, up * rng.uniform(1, 4), rtt, 0.0 if rng.random() < 0.5 else rng.uniform(0, 0.05))


@dataclass(frozen=True)
class HeadTrainConfig:
    hidden: int = 64
    dropout: float = 0.1
    csi_samples: int = 8      # channel states per episode (relabeled under each)
    epochs: int = 30
    batch_size: int = 256
    lr: float = 2e-3
    weight_decay: float = 1e-4
    seed: int = 0
    dagger_passes: int = 1    # passes of traces on the trained head's own WISV trajectories, added to the greedy ones
    token_features: bool = True  # the head also reads the target's embeddings of the two tokens at a mismatch
    # how the greedy pass labels mismatches (episode_traces): "alone" (each judged with the ones
    # before it rejected), "sequential" (the oracle keeps the harmless ones while judging the next)
    # or "executed" (sequential; a changed action is critical only when it executes worse, and the
    # DAgger passes judge the same way)
    labels: str = "alone"
    relabel: RelabelConfig = RelabelConfig()


def relabeled_dataset(episodes: list[list[MismatchTrace]], cfg: HeadTrainConfig, rng: random.Random):
    """(h_draft [N, dd], h_target [N, dt], csi [N, CSI_DIM], tokens [N, 2 d] or None, labels [N])
    over csi_samples channel states per episode."""
    rows_d, rows_t, rows_c, rows_k, labels = [], [], [], [], []
    for episode in episodes:
        if not episode:
            continue
        critical = [t.critical for t in episode]
        for _ in range(cfg.csi_samples):
            csi = sample_csi(rng)
            features = csi.features()
            for trace, label in zip(episode, relabel(critical, csi.quality(), rng, cfg.relabel)):
                rows_d.append(trace.h_draft)
                rows_t.append(trace.h_target)
                rows_k.append(trace.tokens)
                rows_c.append(features)
                labels.append(float(label))
    if not labels:
        raise ValueError("no mismatch traces to train on: the draft agrees with the target everywhere")
    tokens = None if any(k is None for k in rows_k) else torch.stack(rows_k)
    return torch.stack(rows_d), torch.stack(rows_t), torch.stack(rows_c), tokens, torch.tensor(labels)


def train_head(episodes: list[list[MismatchTrace]], cfg: HeadTrainConfig = HeadTrainConfig(), progress=None):
    """The decision head fitted with class-balanced BCE on the relabeled traces; (head, info)."""
    from ..decoding.wisv import DecisionHead, HeadConfig
    rng = random.Random(cfg.seed)
    torch.manual_seed(cfg.seed)
    h_d, h_t, csi, tok, y = relabeled_dataset(episodes, cfg, rng)
    token_dim = tok.shape[1] // 2 if tok is not None and cfg.token_features else 0
    head = DecisionHead(HeadConfig(h_d.shape[1], h_t.shape[1], csi.shape[1], cfg.hidden, cfg.dropout, token_dim))
    positives = float(y.sum())
    pos_weight = torch.tensor((len(y) - positives) / max(positives, 1.0))
    loss_fn = torch.nn.BCEWithLogitsLoss(pos_weight=pos_weight)
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    losses = []
    head.train()
    for _epoch in range(cfg.epochs):
        order = torch.randperm(len(y))
        for a in range(0, len(y), cfg.batch_size):
            idx = order[a:a + cfg.batch_size]
            loss = loss_fn(head.logits(h_d[idx], h_t[idx], csi[idx], tok[idx] if token_dim else None), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        if progress is not None:
            progress(1)
    head.eval()
    return head, {"examples": len(y), "repair_fraction": positives / len(y), "final_loss": sum(losses[-10:]) / min(10, len(losses))}


def acceptance_by_channel(head, episodes: list[list[MismatchTrace]], profiles: list[str], thresholds: list[float]) -> list[dict]:
    """On held-out traces: for each link profile and threshold, the fraction of critical and of
    harmless mismatches the head would keep (accept). A good head keeps harmless ones, rejects
    critical ones, and keeps more on poor links."""
    from ..decoding.wisv import Csi
    from ..wire.link import get_profile
    flat = [t for e in episodes for t in e]
    if not flat:
        return []
    h_d = torch.stack([t.h_draft for t in flat])
    h_t = torch.stack([t.h_target for t in flat])
    tokens = torch.stack([t.tokens for t in flat]) if head.config.token_dim else None
    critical = torch.tensor([t.critical for t in flat])
    rows = []
    for name in profiles:
        csi = Csi.from_profile(get_profile(name))
        r = head.reject_prob(h_d, h_t, csi.features(), tokens)
        for tau in thresholds:
            keep = r <= tau
            rows.append({"link": name, "quality": round(csi.quality(), 3), "threshold": tau,
                         "harmless_kept": float(keep[~critical].float().mean()) if (~critical).any() else None,
                         "critical_kept": float(keep[critical].float().mean()) if critical.any() else None,
                         "mismatches": len(flat), "critical": int(critical.sum())})
    return rows


# --------------------------------------------------------------------------------------------------
# The pipeline stage: edgespec-train wisv

EVAL_PROFILES = ["lan", "wifi-poor", "cellular", "go2-paper"]
EVAL_THRESHOLDS = [0.01, 0.05, 0.1, 0.2, 0.5]


def format_acceptance_table(rows: list[dict]) -> str:
    """Markdown: per link and threshold, the fractions of harmless and critical mismatches kept."""
    out = ["| link | quality | threshold | harmless kept | critical kept |", "|---|---|---|---|---|"]
    for r in rows:
        kept = ["-" if r[k] is None else f"{r[k]:.2f}" for k in ("harmless_kept", "critical_kept")]  # none of that kind held out
        out.append(f"| {r['link']} | {r['quality']:.2f} | {r['threshold']:g} | {kept[0]} | {kept[1]} |")
    return "\n".join(out)


def plot_acceptance(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for link in dict.fromkeys(r["link"] for r in rows):
        mine = [r for r in rows if r["link"] == link]
        line, = ax.plot([r["threshold"] for r in mine], [r["harmless_kept"] for r in mine], marker="o",
                        label=f"{link}: harmless")
        ax.plot([r["threshold"] for r in mine], [r["critical_kept"] for r in mine], marker="x", linestyle="--",
                color=line.get_color(), label=f"{link}: critical")
    ax.set_xscale("log")
    ax.set_xlabel("threshold on the rejection probability (log; 0 = greedy SD)")
    ax.set_ylabel("mismatches kept (held-out traces)")
    ax.set_title("WISV decision head: what it keeps, by link (lossy)")
    ax.set_ylim(-0.02, 1.02)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


_CRITICAL = {
    "alone": "keeping the draft token, each alone, changes the parsed action",
    "sequential": "keeping the draft token, with the harmless ones before it kept, changes the parsed action",
    "executed": "keeping the draft token, with the harmless ones before it kept, changes the action to one that "
                "executes worse in the simulator (a new contact, or more decisions to the goal)"}


def write_head_report(out_dir: str, meta: dict, cfg: HeadTrainConfig, n_frames: int) -> None:
    """The head's README.md and acceptance.png from its metadata (the held-out table in it)."""
    import os
    plot_acceptance(meta["heldout_acceptance"], os.path.join(out_dir, "acceptance.png"))
    with open(os.path.join(out_dir, "README.md"), "w") as f:
        f.write("# WISV decision head (lossy)\n\n"
                f"Two-layer MLP ({cfg.hidden} hidden) over the drafter's and the target's final hidden states and "
                f"the link's CSI features, trained on {meta['traces']['train_mismatches']} mismatches "
                f"({meta['traces']['train_critical']} critical: {_CRITICAL[cfg.labels]}) "
                f"of {meta['traces']['train_episodes']} decisions on {n_frames} simulator frames: greedy SD rounds, then "
                f"{cfg.dagger_passes} pass(es) of the trained head's own WISV rounds (DAgger: the prefixes hold the "
                "mismatches it kept), each relabeled under "
                f"{cfg.csi_samples} sampled channel states (CSI-aware budgeted relabeling, paper 002 Eq. 28-31).\n\n"
                f"Held-out traces ({meta['traces']['heldout_mismatches']} mismatches, "
                f"{meta['traces']['heldout_critical']} critical): the fractions the head keeps per link and "
                "threshold. Keeping a critical mismatch changes the robot's action.\n\n"
                + format_acceptance_table(meta["heldout_acceptance"]) + "\n\n![acceptance](acceptance.png)\n\n"
                f"Command: `{meta['command']}`\n")


def run_wisv_stage(draft_dir: str, target_dir: str, out_dir: str | None, train_examples, heldout_examples,
                   cfg: HeadTrainConfig = HeadTrainConfig(), command: str = "", workers: int = 1) -> dict:
    """Collect traces, relabel, train, measure on held-out traces; save the head beside the target
    (``<target>/wisv``: weights, wisv_head.json with the metrics, README.md, acceptance.png)."""
    import os
    import time
    from dataclasses import asdict
    from tqdm import tqdm
    from ..decoding.engines import load_model
    import tempfile
    draft, target = load_model(draft_dir), load_model(target_dir)
    out_dir = out_dir or os.path.join(target_dir, "wisv")
    many = dict(workers=workers, model_dirs=(draft_dir, target_dir))
    t0 = time.monotonic()
    with tqdm(total=len(train_examples) + len(heldout_examples), desc="wisv: traces", unit="ep") as bar:
        train = collect_traces(draft, target, train_examples, progress=bar.update, labels=cfg.labels, **many)
        heldout = collect_traces(draft, target, heldout_examples, progress=bar.update, **many)
    greedy_train = len(train)
    with tqdm(total=cfg.epochs, desc="wisv: head", unit="epoch") as bar:
        head, info = train_head(train, cfg, progress=bar.update)
    for p in range(cfg.dagger_passes):
        # The first head's own trajectories (kept mismatches in the prefix), labelled by the task
        # and added to the traces: the states a greedy-SD prefix never shows it.
        with tempfile.TemporaryDirectory(prefix="wisv-head-") as head_dir:
            head.save(head_dir)  # the processes load the first head from here
            policies = dagger_policy_specs(head_dir, len(train_examples), random.Random(cfg.seed + 1 + p))
            with tqdm(total=len(train_examples), desc=f"wisv: dagger {p + 1}", unit="ep") as bar:
                train += collect_traces(draft, target, train_examples, progress=bar.update, policies=policies,
                                        executed=cfg.labels == "executed", **many)
        with tqdm(total=cfg.epochs, desc="wisv: head", unit="epoch") as bar:
            head, info = train_head(train, cfg, progress=bar.update)
    trace_s = time.monotonic() - t0
    rows = acceptance_by_channel(head, heldout, EVAL_PROFILES, EVAL_THRESHOLDS)
    count = lambda eps: (sum(len(e) for e in eps), sum(t.critical for e in eps for t in e))  # noqa: E731
    changed = sum(bool(t.action_changed) for e in train for t in e)
    meta = {"lossy": True, "draft_fingerprint": draft.fingerprint(), "target_fingerprint": target.fingerprint(),
            "training": {k: v for k, v in asdict(cfg).items() if k != "relabel"} | {"relabel": asdict(cfg.relabel)},
            "traces": {"train_episodes": len(train), "greedy_episodes": greedy_train, "train_mismatches": count(train)[0],
                       "train_critical": count(train)[1], "train_action_changed": changed,
                       "heldout_episodes": len(heldout),
                       "heldout_mismatches": count(heldout)[0], "heldout_critical": count(heldout)[1],
                       "seconds": round(trace_s, 1), "workers": workers},
            "fit": info, "heldout_acceptance": rows, "command": command}
    head.save(out_dir, **meta)
    write_head_report(out_dir, meta, cfg, len(train_examples))
    print(f"wisv: {info['examples']} relabeled examples ({info['repair_fraction']:.0%} repair), loss "
          f"{info['final_loss']:.3f} -> {out_dir}")
    print(format_acceptance_table(rows))
    return meta
