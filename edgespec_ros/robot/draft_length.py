"""Draft length from the TK-SLT model (paper 003): ODLD (Algorithm 1) and AS2 (Algorithm 2).

One round drafts gamma tokens (c target-step times each), uploads them (b target-step times each)
and verifies once (one target step): with acceptance rate alpha it yields (1 - alpha^(gamma+1)) /
(1 - alpha) tokens in (1 + gamma L) target steps, L = b + c. The speedup over cloud AR is Eq. 11

    S(gamma) = (1 - alpha^(gamma+1)) / ((1 + gamma L) (1 - alpha)),

maximised over real gamma at gamma_0 = [W_-1(-alpha^(1/L - 1) / e) + 1] / ln(alpha) - 1/L
(Eq. 21, Lambert W on its -1 branch); the integer optimum is the better of floor and ceil
(Algorithm 1), or 1 when gamma_0 < 1. AS2 speculates only when S(gamma*) is not below 1.

Ties: Algorithm 2 as printed speculates only when S > 1, but TK-SLT's Table I (falling back
to AR only when S(gamma*) < 1) keeps SD at (alpha, L) = (0.4, 0.4), where S = 1 exactly, and
marks 1* (use AR) at (0.6, 0.6), where S is also 1 in exact arithmetic but 0.9999999999999998 in
IEEE double. So the table is Eq. 11 in double precision with "AR iff S < 1", which is what this
module computes (and test_draft_length.py checks entry by entry).
"""
from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

from scipy.special import lambertw

from .settings import DEFAULTS, GAMMA_MAX, PIPE_DEPTH_MAX


@dataclass(frozen=True)
class DraftPlan:
    mode: str  # "sd" or "ar"
    gamma: int  # the optimal draft length gamma* (also reported when AR is chosen)
    speedup: float  # S(gamma*) predicted by Eq. 11
    gamma0: float  # the real-valued optimum of Eq. 21 (nan where it does not exist)


def speedup(gamma: int, alpha: float, cost: float) -> float:
    """Eq. 11: predicted speedup of SD with draft length gamma over cloud AR (cost L = b + c)."""
    if alpha >= 1.0:
        return (gamma + 1) / (1 + gamma * cost)
    return (1 - alpha ** (gamma + 1)) / ((1 + gamma * cost) * (1 - alpha))


def _check(alpha: float, b: float, c: float) -> float:
    for name, value in (("alpha", alpha), ("b", b), ("c", c)):
        if not math.isfinite(value):
            raise ValueError(f"draft-length model: {name} must be finite, got {value}")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"draft-length model: acceptance rate alpha must be in [0, 1], got {alpha}")
    if b < 0 or c < 0 or b + c <= 0:
        raise ValueError(f"draft-length model: b and c (uplink and draft time per token, in target-step "
                         f"units) must be >= 0 with b + c > 0, got b={b}, c={c}")
    return b + c


def gamma0(alpha: float, cost: float) -> float:
    """Eq. 21, the real maximiser of Eq. 11; nan where it does not exist (alpha in {0, 1}, L >= 1)."""
    if not 0.0 < alpha < 1.0 or cost >= 1.0:
        return math.nan
    log_arg = -1.0 + (1.0 / cost - 1.0) * math.log(alpha)  # ln(-x) for x = -alpha^(1/L - 1) / e
    if log_arg > -700.0:
        w = float(lambertw(-math.exp(log_arg), -1).real)
    else:  # x underflows: solve w e^w = x as w + ln(-w) = ln(-x) by Newton on the -1 branch
        w = log_arg - math.log(-log_arg)
        for _ in range(50):
            step = (w + math.log(-w) - log_arg) / (1.0 + 1.0 / w)
            w -= step
            if abs(step) <= 1e-15 * abs(w):
                break
    return (w + 1.0) / math.log(alpha) - 1.0 / cost


def optimal_draft_length(alpha: float, b: float, c: float, gamma_max: int = GAMMA_MAX) -> tuple[int, float]:
    """ODLD (Algorithm 1): (gamma*, S(gamma*)) for acceptance alpha, uplink b and draft c costs.

    gamma* is capped at gamma_max (alpha -> 1 with small L sends gamma_0 to infinity)."""
    cost = _check(alpha, b, c)
    g0 = gamma0(alpha, cost)
    if alpha >= 1.0 and cost < 1.0:  # S increases without bound in gamma
        g = gamma_max
    elif math.isnan(g0) or g0 < 1:
        g = 1
    else:
        lo, hi = min(math.floor(g0), gamma_max), min(math.ceil(g0), gamma_max)
        g = hi if speedup(lo, alpha, cost) <= speedup(hi, alpha, cost) else lo
    return g, speedup(g, alpha, cost)


def adaptive_selection(alpha: float, b: float, c: float, gamma_max: int = GAMMA_MAX) -> DraftPlan:
    """AS2 (Algorithm 2): speculate with gamma* unless the predicted speedup is below 1."""
    gamma, s = optimal_draft_length(alpha, b, c, gamma_max)
    return DraftPlan("sd" if s >= 1.0 else "ar", gamma, s, gamma0(alpha, b + c))


# --- --gamma auto: ODLD and AS2 on online estimates ------------------------------------------------

@dataclass(frozen=True)
class AutoPlan:
    """What AutoGamma's model predicts now (times in seconds; b, c in units of round_s)."""

    mode: str  # "sd" or "ar": AS2 on the measured AR step time
    gamma: int  # ODLD's gamma* for (alpha, b, c)
    alpha: float  # per-position acceptance probability
    b: float  # uplink + downlink time per drafted token / round_s
    c: float  # drafting time per drafted token / round_s
    round_s: float  # fixed cost of one SD round: verification + link round trip (the paper's T_LLM)
    ar_step_s: float  # cloud AR time per token
    speedup: float  # predicted SD throughput over AR throughput at gamma*: S11(gamma*) ar_step_s / round_s


class _Ew:
    """Exponentially weighted sums: each new observation has weight 1, older ones decay by (1 - rate)."""

    def __init__(self, rate: float, n: int):
        self.rate = rate
        self.sums = [0.0] * n
        self.count = 0

    def add(self, *values: float) -> None:
        keep = 1.0 - self.rate
        self.sums = [keep * s + v for s, v in zip(self.sums, values)]
        self.count += 1


class AutoGamma:
    """``--gamma auto``: choose gamma each SD round by ODLD and SD vs cloud AR each decision by AS2,
    on exponentially weighted estimates from measured rounds. Pure: no clock, no I/O.

    The model. One SD round drafting n tokens costs

        T_round(n) = t_verify + t_rtt + n (t_draft + t_tx),

    a fixed part F = t_verify + t_rtt (the verification forward and the link's round trip, paid
    once per round whatever n) and a per-token part (drafting plus the uplink bytes of one token).
    TK-SLT's Eq. 4 is this with t_rtt = 0 and F = T_LLM; with F in the role of T_LLM,
    b = t_tx / F and c = t_draft / F, a round yields (1 - alpha^(n+1)) / (1 - alpha) tokens in
    (1 + n L) F seconds, so SD's throughput is S11(n) / F with S11 = Eq. 11, and ODLD's gamma*
    maximises it. Cloud AR streams one token per t_ar (its step time; the per-decision round trip
    is paid by both modes), so SD beats AR by S = S11(gamma*) t_ar / F; AS2 picks AR when S < 1.
    With t_rtt = 0 and t_ar = t_verify this is exactly the paper's Algorithm 2. (Folding the
    round trip into b instead, as a per-token cost, would charge it gamma times per round and push
    gamma* towards 1 on every high-latency link.)

    The estimators (rate ``smoothing``: each new round weighs 1, older ones decay by 1 - smoothing):
    - alpha: the maximum-likelihood estimate of the i.i.d. acceptance model behind Eq. 11:
      accepted draft positions over attempted ones, where a round that accepted a of n drafts
      attempted a + 1 positions if a < n (the first rejection ends it) and n if all were accepted.
      (accepted / drafted would count never-attempted positions as rejections and bias alpha low.)
      Drafts after an end-of-sequence token do not count: both models agree on what follows an
      end, and counting it would inflate alpha on the last round of every decision.
    - t_draft: drafting seconds over drafted tokens; t_verify: mean verification seconds per round.
    - t_tx: the slope of link seconds in n, from differences of consecutive rounds of a decision
      (delta t over delta n, weighted by delta n^2, each pair's slope clipped to +- the link's mean
      seconds per drafted token so that one retransmission does not dominate, shrunk towards 0 by
      a ridge of one pair). Differences cancel a drifting round trip: a line through raw
      (n, t) points would read "the round trip grew when gamma* grew" as a per-token cost. While
      n never varies the slope stays 0 (the whole link time counts as fixed), which at worst
      overestimates F by n t_tx.
    - t_rtt: mean of each SD round's link seconds less n t_tx, and of each AR decision's round
      trip (its GENERATE and TOKEN frames carry no draft), so that it follows the link while AR
      is chosen too. (A single line through both would be pinned by old SD rounds: two x values.)
    - t_ar: mean target step seconds of AR decisions.

    Policy. The first decision is AR (measures t_ar and the round trip) unless ``ar_step_s`` gives
    t_ar up front; the next is SD with ``gamma_init`` (measures the rest); then AS2 decides each
    decision, and within an SD decision every round drafts ODLD's gamma* on the latest estimates.
    While AR is chosen alpha, t_draft and t_tx cannot be measured, so every ``probe_every``
    decisions (doubling after each probe that AR survives, up to ``probe_max``) one SD decision
    probes again, but only when SD could pay at all: when AS2 with an optimistic acceptance
    ``alpha_probe`` would choose SD. (A drafter slower per token than the target's verification
    never gets probed.) A probe starts alpha afresh from its own rounds: the old estimate is the
    one that chose AR, and mixing it in would take several probes to notice a better drafter.

    Samples. A time that is not a finite number (a NaN, an infinity) is no measurement: its
    observation is rejected whole and counted (``rejected_samples``), never averaged in (one NaN
    would poison every later estimate, and every choice with it). ``reset`` starts the estimates
    afresh (the robot does on each new connection to a verifier: another verifier, another link).
    """

    def __init__(self, smoothing: float = 0.05, gamma_init: int | None = None, gamma_max: int = 16,
                 probe_every: int = 8, probe_max: int = 64, alpha_probe: float = 0.95, ar_step_s: float | None = None,
                 draft_token_s: float | None = None):
        if gamma_init is None:  # the drafter's gamma
            gamma_init = DEFAULTS.gamma
        if not 0.0 < smoothing <= 1.0:
            raise ValueError(f"auto gamma: smoothing must be in (0, 1], got {smoothing}")
        if not 1 <= gamma_init <= gamma_max <= GAMMA_MAX:
            raise ValueError(f"auto gamma: need 1 <= gamma_init <= gamma_max <= {GAMMA_MAX}, "
                             f"got gamma_init={gamma_init}, gamma_max={gamma_max}")
        if probe_every < 1 or probe_max < probe_every:
            raise ValueError(f"auto gamma: need 1 <= probe_every <= probe_max, got {probe_every}, {probe_max}")
        for name, value in (("ar_step_s", ar_step_s), ("draft_token_s", draft_token_s)):
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise ValueError(f"auto gamma: {name} must be a finite number >= 0, got {value!r}")
        self._config = dict(smoothing=smoothing, gamma_init=gamma_init, gamma_max=gamma_max, probe_every=probe_every,
                            probe_max=probe_max, alpha_probe=alpha_probe, draft_token_s=draft_token_s)
        self.rejected_samples = 0  # observations with a time that is not a finite number (never used)
        self.gamma_init, self.gamma_max = gamma_init, gamma_max
        self.probe_every, self.probe_max, self.alpha_probe = probe_every, probe_max, alpha_probe
        self._accept = self._acceptance_prior(smoothing)  # accepted, attempted positions
        self._draft = _Ew(smoothing, 2)  # draft seconds, drafted tokens
        self._verify = _Ew(smoothing, 2)  # verify seconds, rounds
        # per kind of block (carrying q, a sampled decision's; or ids only, a greedy one's, verified by
        # the argmax rule): SD rounds' link seconds and drafted tokens, and consecutive rounds' sum
        # dn^2 (dt / dn), sum dn^2 (``set_payload`` says which the next rounds are)
        self._links = {q: (_Ew(smoothing, 2), _Ew(smoothing, 2)) for q in (False, True)}
        self._carries_q = False
        self._last_round: tuple[int, float] | None = None  # (n, link seconds) of this decision's last round
        self._rtt = _Ew(smoothing, 2)  # round-trip seconds, observations
        self._ar = _Ew(smoothing, 2)  # step seconds, steps
        if ar_step_s is not None:
            self._ar.add(ar_step_s, 1.0)
        self._ar_run = 0  # AR decisions since the last SD one
        self._probe_interval = probe_every
        self.probes = 0  # SD decisions taken only to re-measure alpha while AR was chosen
        # the robot's own seconds per draft token where known before it drafts (an emulated profile's):
        # lets mode auto skip measuring a speculative path that could not win at any acceptance
        self.draft_prior_s = draft_token_s
        self._auto_mode: str | None = None  # mode auto: the path of the last decision
        self.last_prediction: dict[str, float] | None = None  # mode auto: predict() at the last choice
        # mode auto: per path, its last decisions' measured seconds per token over predict()'s (``calibration``)
        self._calibration: dict[str, deque] = {}

    def reset(self, ar_step_s: float | None = None) -> None:
        """Forget every estimate, as a new controller with the same settings (``ar_step_s``: the
        new verifier's AR step time where it says it); ``rejected_samples`` carries on."""
        rejected = self.rejected_samples
        self.__init__(**self._config, ar_step_s=ar_step_s)
        self.rejected_samples = rejected

    def _finite(self, *values: float | None) -> bool:
        """Whether every time of one observation is a finite number (else it is counted and rejected)."""
        if all(v is None or math.isfinite(v) for v in values):
            return True
        self.rejected_samples += 1
        return False

    @property
    def _link(self) -> _Ew:
        return self._links[self._carries_q][0]

    @property
    def _slope(self) -> _Ew:
        return self._links[self._carries_q][1]

    def set_payload(self, carries_q: bool) -> None:
        """Whether the coming decision's blocks carry q (``wire.frames.carries_q``): a sampled
        decision's q costs the uplink per draft, a greedy one's ids do not, so each kind keeps its
        own per-token link time (a resampled decision must not make the greedy ones look slow)."""
        if bool(carries_q) != self._carries_q:
            self._carries_q = bool(carries_q)
            self._last_round = None  # the slope pairs rounds of one kind

    @staticmethod
    def _acceptance_prior(rate: float) -> _Ew:
        """alpha's sums before any round: one accepted of two attempted positions (alpha = 0.5,
        the weight of two positions), so that a first all-accepted round reads alpha = 5/6 for
        gamma 4, not 1 (which would draft gamma_max). It decays like any old round."""
        prior = _Ew(rate, 2)
        prior.sums = [1.0, 2.0]
        return prior

    # --- observations -------------------------------------------------------------------------

    def observe_round(self, drafted: int, accepted: int, draft_s: float, link_s: float, verify_s: float,
                      useful: int | None = None) -> None:
        """One SD round: drafted tokens, how many were accepted, and its measured times (seconds).
        useful: the drafts up to and including the first end-of-sequence token, where there is one
        (drafts after it were paid for, but their acceptance says nothing: they are cut anyway)."""
        if drafted < 1 or not 0 <= accepted <= drafted:
            raise ValueError(f"auto gamma: a round needs 1 <= drafted and 0 <= accepted <= drafted, "
                             f"got drafted={drafted}, accepted={accepted}")
        if not self._finite(draft_s, link_s, verify_s):
            return
        useful = drafted if useful is None else min(max(useful, 1), drafted)
        accepted_useful = min(accepted, useful)
        attempted = accepted_useful + 1 if accepted_useful < useful else useful
        self._accept.add(accepted_useful, attempted)
        self._draft.add(max(draft_s, 0.0), drafted)
        self._verify.add(max(verify_s, 0.0), 1.0)
        link_s = max(link_s, 0.0)
        self._link.add(link_s, drafted)
        if self._last_round is not None and self._last_round[0] != drafted:
            dn, dt = drafted - self._last_round[0], link_s - self._last_round[1]
            cap = self._link.sums[0] / self._link.sums[1]
            self._slope.add(dn * dn * min(max(dt / dn, -cap), cap), dn * dn)
        self._last_round = (drafted, link_s)
        self._rtt.add(max(link_s - drafted * self._per_token_link_s(), 0.0), 1.0)

    def observe_ar(self, steps: int, step_s: float, round_trip_s: float | None = None) -> None:
        """One AR decision: steps decoded with step_s target seconds in all, and (where measured)
        the link round trip of its GENERATE request (stream time not spent in target steps)."""
        if not self._finite(step_s, round_trip_s):
            return
        if steps >= 1:
            self._ar.add(max(step_s, 0.0), steps)
        if round_trip_s is not None:
            self._rtt.add(max(round_trip_s, 0.0), 1.0)

    # --- estimates and choices -----------------------------------------------------------------

    def _per_token_link_s(self) -> float:
        if self._link.count == 0:
            return 0.0
        weighted_slopes, weight = self._slope.sums
        slope = max(weighted_slopes / (weight + _SLOPE_RIDGE), 0.0)
        return min(slope, self._link.sums[0] / self._link.sums[1])  # no negative round trips

    def link_line(self) -> tuple[float, float]:
        """(t_rtt, t_tx): the estimated link seconds per round and per drafted token."""
        rtt = self._rtt.sums[0] / self._rtt.sums[1] if self._rtt.count else 0.0
        return rtt, self._per_token_link_s()

    def plan(self, alpha: float | None = None) -> AutoPlan | None:
        """The model's prediction on the current estimates (alpha overrides the estimate); None
        before any SD round was measured."""
        if self._accept.count == 0:
            if alpha is None or self.draft_prior_s is None or self._ar.count == 0:
                return None
            # before any SD round, for an assumed alpha: the draft prior, a pass as long as an AR step
            # (the paper's assumption) and the AR decision's round trip, no per-token link cost
            t_draft, t_verify = self.draft_prior_s, self._ar.sums[0] / self._ar.sums[1]
            t_rtt, t_tx = self.link_line()[0], 0.0
        else:
            if alpha is None:
                accepted, attempted = self._accept.sums
                alpha = accepted / attempted if attempted > 0 else 0.0
            t_draft = self._draft.sums[0] / self._draft.sums[1]
            t_verify = self._verify.sums[0] / self._verify.sums[1]
            t_rtt, t_tx = self.link_line()
        round_s = max(t_verify + t_rtt, _MIN_S)
        # Until AR is measured, the paper's assumption: one target forward costs the same either way.
        t_ar = self._ar.sums[0] / self._ar.sums[1] if self._ar.count else t_verify
        b, c = t_tx / round_s, max(t_draft / round_s, _MIN_S)
        gamma, s11 = optimal_draft_length(min(max(alpha, 0.0), 1.0), b, c, self.gamma_max)
        s = s11 * t_ar / round_s
        return AutoPlan("sd" if s >= 1.0 else "ar", gamma, alpha, b, c, round_s, t_ar, s)

    def begin_decision(self) -> str:
        """The mode of the next decision ("sd" or "ar"); call once at the start of each decision."""
        self._last_round = None
        if self._ar.count == 0:
            mode = "ar"  # measure the AR arm first
        elif self._accept.count == 0:
            mode = "sd"
        else:
            mode = self.plan().mode
            if mode == "sd":
                self._probe_interval = self.probe_every
            elif self._ar_run >= self._probe_interval and self.plan(alpha=self.alpha_probe).mode == "sd":
                mode = "sd"
                self.probes += 1
                self._accept = self._acceptance_prior(self._accept.rate)  # the alpha that chose AR is stale
                self._probe_interval = min(2 * self._probe_interval, self.probe_max)
        self._ar_run = self._ar_run + 1 if mode == "ar" else 0
        return mode

    def predict(self, alpha: float | None = None, pipe_depth: int | None = None) -> dict[str, float] | None:
        """Predicted seconds per committed token of each path on the current estimates (None
        before an SD round was measured), with F = t_verify + t_rtt, sd at ODLD's gamma* and pipe
        at its own gamma and depth (``pipe_plan``; ``pipe_depth`` fixes the depth):
        - ``ar``: the measured target step (the decision's one round trip is paid by every mode);
        - ``sd``: one round, F + gamma (t_draft + t_tx), per E[L] = (1 - alpha^(gamma+1)) / (1 - alpha)
          committed tokens (Eq. 11's model);
        - ``pipe``: PicoSpec's Eq. 9 generalised to ``depth`` blocks in flight (``_pipe_block_s``)."""
        plan = self.plan(alpha)
        if plan is None:
            return None
        a, g, F = min(max(plan.alpha, 0.0), 1.0), plan.gamma, plan.round_s
        t_draft, t_tx = plan.c * F, plan.b * F
        pipe_gamma, depth = self._pipe_plan(a, F, t_draft, t_tx, pipe_depth)
        return {"ar": plan.ar_step_s, "sd": (F + g * (t_draft + t_tx)) / _committed(a, g),
                "pipe": _pipe_block_s(a, pipe_gamma, F, t_draft, t_tx, self._t_verify(), depth)
                / _committed(a, pipe_gamma)}

    def _t_verify(self) -> float:
        """The measured verification seconds per round; before any, an AR step's (``plan``'s assumption)."""
        if self._verify.count:
            return self._verify.sums[0] / self._verify.sums[1]
        return self._ar.sums[0] / self._ar.sums[1] if self._ar.count else 0.0

    def _pipe_plan(self, a: float, F: float, t_draft: float, t_tx: float,
                   depth: int | None = None) -> tuple[int, int]:
        """The pipeline's own (gamma, depth): the generalised Eq. 9 seconds per token minimised
        over gamma, each gamma with the depth that hides one block's round behind the blocks ahead
        of it (``_pipe_cover``) unless ``depth`` is fixed. (ODLD's gamma* is the stop-and-wait
        optimum; a pipeline that hides the round wants blocks only as long as its drafting keeps
        the cloud busy, since every rejection voids what was drafted ahead.)"""
        t_verify = self._t_verify()
        best = None
        for g in range(1, self.gamma_max + 1):
            d = depth or _pipe_cover(g, F, t_draft, t_tx, t_verify)
            cost = _pipe_block_s(a, g, F, t_draft, t_tx, t_verify, d) / _committed(a, g)
            if best is None or cost < best[0]:
                best = (cost, g, d)
        return best[1], best[2]

    def next_pipe_plan(self, depth: int | None = None) -> tuple[int, int] | None:
        """(gamma, blocks in flight) of the pipeline's next decision on the latest estimates
        (``depth`` fixes the second); None before anything is measured."""
        plan = self.plan()
        if plan is None:
            return None
        a, F = min(max(plan.alpha, 0.0), 1.0), plan.round_s
        return self._pipe_plan(a, F, plan.c * F, plan.b * F, depth)

    def next_pipe_gamma(self) -> int:
        """The draft length of the pipeline's next block (``next_pipe_plan``'s gamma)."""
        plan = self.next_pipe_plan()
        return self.gamma_init if plan is None else plan[0]

    def observe_decision(self, path: str, seconds_per_token: float) -> None:
        """Mode auto: a decision on ``path`` took ``seconds_per_token`` (its wall time over its
        tokens). Its ratio to what ``predict`` says for that path on the estimates it updated is
        kept, the last CALIBRATION_KEPT of each path (each clipped to [1/CALIBRATION_CLIP,
        CALIBRATION_CLIP]); their median is the path's ``calibration``. The model leaves out what
        every decision pays beside its rounds (the prompt, the prefills, the host's work) and a
        pipeline's stalls, which differ by path; a path whose decisions run slower than predicted
        is then chosen on what it does, not on the formula, and one odd decision (a short one, a
        stall) does not move it. Nothing is kept before the model can predict."""
        if not self._finite(seconds_per_token):
            return
        pred = self.predict()
        if pred is None or path not in pred or pred[path] <= 0 or not seconds_per_token > 0:
            return
        ratio = min(max(seconds_per_token / pred[path], 1 / CALIBRATION_CLIP), CALIBRATION_CLIP)
        self._calibration.setdefault(_calibrated_as(path), deque(maxlen=CALIBRATION_KEPT)).append(ratio)

    def calibration(self, path: str) -> float:
        """Mode auto: the median measured / predicted seconds per token of ``path``'s last decisions
        (1.0 before any). The speculative paths share one: what the model leaves out is mostly the
        decision's own (prompt, prefills, host work), the same for both, and the model already
        ranks them (a block drafted ahead never costs more than one drafted after); one ratio each
        would let a single odd decision of one path hand the choice to the slower."""
        kept = self._calibration.get(_calibrated_as(path))
        return statistics.median(kept) if kept else 1.0

    def begin_auto_decision(self) -> str:
        """``mode auto``: the path of the next decision, "ar", "sd" or "pipe" (call once at the
        start of each). As ``begin_decision`` measures (AR first, then an SD decision, probes of
        the speculative paths while AR wins), it then takes the path ``predict`` says is fastest,
        each path's prediction scaled by its ``calibration`` (what its decisions really cost), but keeps the current one unless another is predicted ``AUTO_SWITCH_MARGIN`` faster (the
        estimates are noisy; a path flapping every decision helps nobody). ``last_prediction``:
        what the choice was made on."""
        self._last_round = None
        self.last_prediction = None
        if self._ar.count == 0:
            mode = "ar"
        elif self._accept.count == 0:
            # measure a speculative path, unless even an optimistic acceptance could not make one win
            optimistic = self.predict(alpha=self.alpha_probe)
            mode = "sd" if optimistic is None or min(optimistic["sd"], optimistic["pipe"]) < optimistic["ar"] else "ar"
        else:
            pred = self.last_prediction = {k: v * self.calibration(k) for k, v in self.predict().items()}
            best = min(pred, key=pred.get)
            current = self._auto_mode
            mode = current if current in pred and pred[current] <= pred[best] * (1 + AUTO_SWITCH_MARGIN) else best
            if mode != "ar":
                self._probe_interval = self.probe_every
            elif self._ar_run >= self._probe_interval:
                optimistic = self.predict(alpha=self.alpha_probe)
                spec = min(("sd", "pipe"), key=optimistic.get)
                if optimistic[spec] < optimistic["ar"]:
                    mode = spec
                    self.probes += 1
                    self._accept = self._acceptance_prior(self._accept.rate)
                    self._probe_interval = min(2 * self._probe_interval, self.probe_max)
        self._ar_run = self._ar_run + 1 if mode == "ar" else 0
        self._auto_mode = mode
        return mode

    def estimates(self) -> dict[str, float]:
        """Seconds per drafted token, per verification and per round trip (nan until measured)."""
        nan = float("nan")
        return {"t_draft": self._draft.sums[0] / self._draft.sums[1] if self._draft.count else nan,
                "t_verify": self._verify.sums[0] / self._verify.sums[1] if self._verify.count else nan,
                "t_rtt": self.link_line()[0] if self._rtt.count else nan}

    def next_gamma(self) -> int:
        """The draft length of the next SD round: gamma* on the latest estimates."""
        plan = self.plan()
        return self.gamma_init if plan is None else plan.gamma


def _calibrated_as(path: str) -> str:
    """The calibration a path's decisions share: AR's own, or one for the speculative paths."""
    return "ar" if path == "ar" else "speculative"


def _committed(a: float, g: int) -> float:
    """Expected tokens a round of g drafts commits at acceptance a: (1 - a^(g+1)) / (1 - a)."""
    return (1 - a ** (g + 1)) / (1 - a) if a < 1.0 else g + 1.0


def _pipe_block_s(a: float, g: int, F: float, t_draft: float, t_tx: float, t_verify: float = 0.0,
                  depth: int = 1) -> float:
    """PicoSpec's Eq. 9 with ``depth`` blocks in flight. A block drafted ahead stands with
    P_hit = a^g (its predecessor accepted whole) and then costs the pipeline's period: the slowest
    of drafting it (g t_draft), the cloud verifying it (t_verify) and its share of the round that
    the blocks in flight hide, (F + g t_tx) / depth; else it is a refill drafted after the verdict,
    g t_draft + F + g t_tx. With depth 1 the period is max(g t_draft, F + g t_tx): Eq. 9 itself."""
    hit = a ** g
    period = max(g * t_draft, t_verify, (F + g * t_tx) / depth)
    return hit * period + (1 - hit) * (g * t_draft + F + g * t_tx)


def _pipe_cover(g: int, F: float, t_draft: float, t_tx: float, t_verify: float) -> int:
    """Blocks in flight that keep the cloud from waiting on the link: one block's whole round,
    drafting included, over the pipeline's period (PicoSpec's overlap condition), in
    1..PIPE_DEPTH_MAX."""
    period = max(g * t_draft, t_verify)
    if period <= 0:
        return PIPE_DEPTH_MAX
    return max(1, min(PIPE_DEPTH_MAX, math.ceil((F + g * (t_draft + t_tx)) / period)))


AUTO_SWITCH_MARGIN = 0.05  # mode auto leaves its current path only for one predicted this much faster
CALIBRATION_KEPT = 5  # mode auto: a path's measured/predicted ratio is the median of its last 5 decisions
CALIBRATION_CLIP = 4.0  # ... each decision's ratio counted within [1/CLIP, CLIP]
_MIN_S = 1e-9  # keeps the model's ratios finite when a time measured 0 (in-process verifiers)
_SLOPE_RIDGE = 1.0  # the link's per-token slope is shrunk towards 0 by one pair of rounds with dn = 1
