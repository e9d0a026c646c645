"""Per-decision metrics and their aggregation over many decisions (vLLM spec_decode/metrics style)."""
from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field


@dataclass
class DecisionMetrics:
    """What one decision cost. Times in seconds; acceptance is kept per draft position."""

    mode: str = "sd"  # the mode actually used (with gamma "auto", sd or ar as AS2 chose; mode auto's choice)
    gamma: int | str = 0  # the configured draft length, or "auto"
    # mode auto: the ms per token each path was predicted to cost when this one was chosen (empty otherwise)
    predicted_ms_per_token: dict = field(default_factory=dict)
    gamma_per_round: list[int] = field(default_factory=list)  # gamma "auto": each round's chosen gamma
    tokens: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # count accepted at position i
    drafted_per_position: list[int] = field(default_factory=list)  # count drafted at position i
    uplink_bytes: int = 0
    downlink_bytes: int = 0
    draft_uplink_bytes: int = 0  # the VERIFY frames alone: draft ids + encoded q + framing
    resampled: int = 0  # rounds that ended in a rejection (a token resampled by the cloud)
    tree_nodes: int = 0  # token trees: nodes sent (``drafted`` counts their depth, as a chain's tokens)
    t_draft: float = 0.0
    t_uplink: float = 0.0
    t_verify: float = 0.0
    t_downlink: float = 0.0
    wall_s: float = 0.0
    prompt_tokens: int = 0  # the decision's prompt (a policy with memory: its earlier turns too)
    cloud_prefill_s: float = 0.0  # the verifier's prefill compute for it (PREFILL_OK; 0 when not reported)
    # fsd: pre-draft cache outcomes (rounds that needed a next block) and early-exit statistics
    predraft_hits: int = 0
    predraft_misses: int = 0
    exit_rounds: int = 0  # rounds whose verdict reported an exit layer
    exit_layer_sum: int = 0  # sum of the earliest exit layer agreeing with the final verdict
    exits_received: int = 0
    fork_s: float = 0.0  # time spent cloning the draft state for pre-drafting
    hit_wait_s: float = 0.0  # on hits, time waited for the matching pre-draft to finish (T_r)
    # pipe modes: the pipeline's behaviour
    pipe_depth: int = 0  # blocks allowed in flight
    max_in_flight: int = 0  # most blocks in flight at once
    pipe_flushes: int = 0  # verdicts that voided drafting ahead (a rejection interrupting the pipeline)
    pipe_voided_blocks: int = 0  # blocks in flight dropped by those verdicts (drafted, sent, never verified)
    pipe_truncations: int = 0  # blocks cut short because the verifier had nothing left to verify
    pipe_stall_s: float = 0.0  # time the robot waited with a full pipeline (its device free for pre-drafts)
    queue_s: float = 0.0  # time blocks waited at the verifier behind earlier blocks
    pipe_cond_sent: int = 0  # pipe+fsd: conditional blocks sent before the verdict they guess
    pipe_cond_hits: int = 0  # of those, guesses that were right (verified at once after the rejection)
    wisv_relaxed: int = 0  # wisv (LOSSY): mismatches the decision head kept
    hidden_rows: int = 0  # wisv: drafter hidden rows uploaded
    hidden_exchanges: int = 0  # wisv selective upload: extra round trips for hidden rows
    # Where the cloud's time went (CloudTimeline): idle seconds before each pass, by what the pass
    # waited for (PASS_CAUSES), and the number of passes of each cause.
    cloud_idle_s: dict = field(default_factory=dict)
    cloud_passes: dict = field(default_factory=dict)

    def record_exits(self, reply) -> None:
        if reply.exit_layer:
            self.exit_rounds += 1
            self.exit_layer_sum += reply.exit_layer
        self.exits_received += reply.exits_received

    @property
    def cache_miss_rate(self) -> float | None:
        n = self.predraft_hits + self.predraft_misses
        return self.predraft_misses / n if n else None

    def add_link(self, up: int, down: int) -> None:
        self.uplink_bytes += up
        self.downlink_bytes += down

    def record_block(self, reply, block) -> None:
        """One verified ``decoding.verifier.Block``: a chain's drafts, or a token tree counted as a
        chain of its depth (per-depth acceptance), its nodes in ``tree_nodes``."""
        if block.parents is None:
            self.record_round(reply, len(block.draft_ids))
            return
        from dataclasses import replace
        from .verifier import mask_of
        depth = max(block.tree.depths())
        self.record_round(replace(reply, accepted_mask=mask_of(reply.accepted, depth)), depth)
        self.tree_nodes += len(block.draft_ids)

    def record_round(self, reply, n_drafted: int) -> None:
        """Account one verification round from a VerifyReply."""
        self.rounds += 1
        self.drafted += n_drafted
        self.accepted += reply.accepted
        self.resampled += reply.accepted < n_drafted
        self.draft_uplink_bytes += reply.uplink_bytes
        while len(self.drafted_per_position) < n_drafted:
            self.drafted_per_position.append(0)
            self.accepted_per_position.append(0)
        for i in range(n_drafted):
            self.drafted_per_position[i] += 1
            if i < len(reply.accepted_mask) and reply.accepted_mask[i]:
                self.accepted_per_position[i] += 1
        self.t_verify += reply.verify_s
        self.queue_s += getattr(reply, "queue_s", 0.0)
        self.t_uplink += reply.uplink_s
        self.t_downlink += reply.downlink_s
        self.add_link(reply.uplink_bytes, reply.downlink_bytes)
        self.wisv_relaxed += getattr(reply, "relaxed", 0)
        self.hidden_rows += getattr(reply, "hidden_rows", 0)
        self.hidden_exchanges += getattr(reply, "hidden_exchanges", 0)

    @property
    def tau(self) -> float:
        return self.tokens / self.rounds if self.rounds else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(tau=self.tau, acceptance_rate=self.acceptance_rate, cache_miss_rate=self.cache_miss_rate)
        return d


# What a verification pass waited for, in the order a decision meets them (CloudTimeline).
PASS_CAUSES = {
    "fill": "the decision's first block: the prompt's uplink, both prefills, the first block drafted and sent",
    "drafted": "a new epoch's first block, drafted after the verdict that opened it (SD: every round)",
    "pre-drafted": "a new epoch's first block, from the pre-draft cache (FSD hit)",
    "conditional": "a new epoch's first block, sent before the verdict on an early exit's guess",
    "hint": "a block of a hint's tokens (act_while_verifying confirm), sent after the verdict before it",
    "chained": "a block of the same epoch: the cloud waited for the robot to draft it",
    "drain": "after the last pass: the last verdict's way down",
}


class CloudTimeline:
    """Where the cloud spent one decision, reconstructed on the robot from each verdict: its pass
    ended when the verdict left (arrival - downlink) and began ``verify_s`` earlier; the gap since
    the previous pass ended (or since the decision began) is idle time, charged to what the pass
    waited for. Passes are the session's own, in verdict order (voided blocks cost no pass).
    busy + idle = wall: the idle split says which loss a change would close."""

    def __init__(self, m: DecisionMetrics, started_at: float):
        self.m = m
        self.last_end = started_at

    def verdict(self, reply, cause: str, received_at: float) -> None:
        """Charge the idle time before this verdict's pass to ``cause`` (a PASS_CAUSES key)."""
        end = received_at - reply.downlink_s
        start = end - reply.verify_s
        self._charge(cause, max(0.0, start - self.last_end))
        self.m.cloud_passes[cause] = self.m.cloud_passes.get(cause, 0) + 1
        self.last_end = max(self.last_end, end)

    def end(self, ended_at: float) -> None:
        """The decision is over: the time since the last pass is the drain."""
        self._charge("drain", max(0.0, ended_at - self.last_end))
        self.last_end = ended_at

    def _charge(self, cause: str, seconds: float) -> None:
        if cause not in PASS_CAUSES:
            raise ValueError(f"unknown pass cause {cause!r}")
        self.m.cloud_idle_s[cause] = self.m.cloud_idle_s.get(cause, 0.0) + seconds


@dataclass
class RunSummary:
    """Aggregate of decisions of one mode on one link/compute profile (one bench row)."""

    mode: str
    link: str
    compute: str
    decisions: int = 0
    tokens: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    uplink_bytes: int = 0
    downlink_bytes: int = 0
    draft_uplink_bytes: int = 0
    resampled: int = 0
    tree_nodes: int = 0  # token trees: nodes sent (``drafted`` counts their depth)
    wall_s: float = 0.0
    t_draft: float = 0.0
    t_uplink: float = 0.0
    t_verify: float = 0.0
    t_downlink: float = 0.0
    predraft_hits: int = 0
    predraft_misses: int = 0
    exit_rounds: int = 0
    exit_layer_sum: int = 0
    exits_received: int = 0
    fork_s: float = 0.0
    hit_wait_s: float = 0.0
    pipe_depth: int = 0
    max_in_flight: int = 0
    pipe_flushes: int = 0
    pipe_voided_blocks: int = 0
    pipe_truncations: int = 0
    pipe_stall_s: float = 0.0
    queue_s: float = 0.0
    pipe_cond_sent: int = 0
    pipe_cond_hits: int = 0
    wisv_relaxed: int = 0
    hidden_rows: int = 0
    hidden_exchanges: int = 0
    prompt_tokens: int = 0
    cloud_prefill_s: float = 0.0
    gamma: int | str = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    decision_ms: list[float] = field(default_factory=list)
    decision_modes: list[str] = field(default_factory=list)  # the mode each decision actually used
    gamma_per_round: list[int] = field(default_factory=list)  # gamma "auto": every round's chosen gamma
    cloud_idle_s: dict = field(default_factory=dict)
    cloud_passes: dict = field(default_factory=dict)

    def add(self, m: DecisionMetrics) -> None:
        self.decisions += 1
        self.gamma = m.gamma
        self.decision_modes.append(m.mode)
        self.gamma_per_round += m.gamma_per_round
        for name in ("tokens", "rounds", "drafted", "tree_nodes", "accepted", "uplink_bytes", "downlink_bytes",
                     "draft_uplink_bytes", "resampled", "wall_s", "t_draft", "t_uplink", "t_verify", "t_downlink",
                     "predraft_hits", "predraft_misses", "exit_rounds", "exit_layer_sum", "exits_received", "fork_s", "hit_wait_s",
                     "pipe_flushes", "pipe_voided_blocks", "pipe_truncations", "pipe_stall_s", "queue_s",
                     "pipe_cond_sent", "pipe_cond_hits", "wisv_relaxed", "hidden_rows", "hidden_exchanges",
                     "prompt_tokens", "cloud_prefill_s"):
            setattr(self, name, getattr(self, name) + getattr(m, name))
        self.pipe_depth = max(self.pipe_depth, m.pipe_depth)
        self.max_in_flight = max(self.max_in_flight, m.max_in_flight)
        for i, (a, d) in enumerate(zip(m.accepted_per_position, m.drafted_per_position)):
            if i >= len(self.drafted_per_position):
                self.drafted_per_position.append(0)
                self.accepted_per_position.append(0)
            self.accepted_per_position[i] += a
            self.drafted_per_position[i] += d
        self.decision_ms.append(m.wall_s * 1000)
        for mine, theirs in ((self.cloud_idle_s, m.cloud_idle_s), (self.cloud_passes, m.cloud_passes)):
            for cause, value in theirs.items():
                mine[cause] = mine.get(cause, 0) + value

    def row(self) -> dict:
        """The JSON row of edgespec-bench."""
        per_pos = [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]
        return {
            "mode": self.mode,
            "link": self.link,
            "compute": self.compute,
            "gamma": self.gamma if self.mode != "ar" else 0,
            "decisions": self.decisions,
            "tokens": self.tokens,
            "rounds": self.rounds,
            "drafted": self.drafted,
            "tree_nodes": self.tree_nodes,
            "tau": self.tokens / self.rounds if self.rounds else 0.0,
            "acceptance_rate": self.accepted / self.drafted if self.drafted else None,
            "acceptance_per_position": per_pos,
            "ms_per_token": 1000 * self.wall_s / self.tokens if self.tokens else None,
            "ms_per_decision": statistics.median(self.decision_ms) if self.decision_ms else None,
            "ms_per_decision_mean": 1000 * self.wall_s / self.decisions if self.decisions else None,
            "uplink_bytes": self.uplink_bytes,
            "downlink_bytes": self.downlink_bytes,
            # Measured VERIFY frames (ids + encoded q + framing) per drafted token; the PREFILL is in uplink_bytes.
            "uplink_bytes_per_draft_token": self.draft_uplink_bytes / self.drafted if self.drafted else None,
            "resampling_rate": self.resampled / self.rounds if self.rounds and self.drafted else None,
            "prompt_tokens_mean": self.prompt_tokens / self.decisions if self.decisions else None,
            # the verifier's prefill compute per decision (its PREFILL_OK figure; emulated profiles: theirs)
            "cloud_prefill_ms_mean": 1000 * self.cloud_prefill_s / self.decisions if self.decisions else None,
            **(self._fsd_row() if self.mode in ("fsd", "pipe+fsd") else {}),
            **(self._pipe_row() if self.mode.startswith("pipe") else {}),
            **(self._auto_row() if self.gamma == "auto" and self.mode != "ar" else {}),
            **({"wisv_relaxed": self.wisv_relaxed, "hidden_rows": self.hidden_rows,
                "hidden_exchanges": self.hidden_exchanges} if self.hidden_rows or self.wisv_relaxed else {}),
            **({"cloud_idle_s": dict(self.cloud_idle_s), "cloud_passes": dict(self.cloud_passes)}
               if self.cloud_passes else {}),
            "time_split_s": {"draft": self.t_draft, "uplink": self.t_uplink, "verify": self.t_verify,
                             "downlink": self.t_downlink, "wall": self.wall_s},
        }

    def _auto_row(self) -> dict:
        g = self.gamma_per_round
        return {
            "ar_decisions": self.decision_modes.count("ar"),  # decisions where AS2 chose cloud AR
            "gamma_mean": sum(g) / len(g) if g else None,
            "gamma_counts": {str(k): g.count(k) for k in sorted(set(g))},
        }

    def _pipe_row(self) -> dict:
        return {
            "pipe_depth": self.pipe_depth,
            "max_in_flight": self.max_in_flight,
            "pipe_flushes": self.pipe_flushes,
            "pipe_voided_blocks": self.pipe_voided_blocks,
            "pipe_truncations": self.pipe_truncations,
            "pipe_stall_s": self.pipe_stall_s,
            "verifier_queue_s": self.queue_s,
            "pipe_cond_sent": self.pipe_cond_sent,
            "pipe_cond_hits": self.pipe_cond_hits,
        }

    def _fsd_row(self) -> dict:
        n = self.predraft_hits + self.predraft_misses
        return {
            "cache_miss_rate": self.predraft_misses / n if n else None,
            # earliest early exit whose verdict equals the final one (num_layers when none did)
            "avg_exit_layer": self.exit_layer_sum / self.exit_rounds if self.exit_rounds else None,
            "exits_per_round": self.exits_received / self.rounds if self.rounds else 0.0,
            "fork_ms_per_round": 1000 * self.fork_s / self.rounds if self.rounds else 0.0,
            "predraft_hits": self.predraft_hits,
            "predraft_misses": self.predraft_misses,
            "t_hit_wait_s": self.hit_wait_s / self.predraft_hits if self.predraft_hits else 0.0,  # T_r
        }
