"""The robot's decoding settings: one type, and the one definition of every default.

``DrafterSettings`` is what a user sets: the drafter node's parameters of the same names
(``nodes/params.py`` builds their rows from these fields, descriptions and bounds included),
``config/drafter.yaml`` and the launch files override some, and ``edgespec-bench``,
``edgespec-demo`` and training take their defaults from ``DEFAULTS``. ``DecodeConfig`` is one
decision's resolved form (``DrafterSettings.decode_config``: the decision's seed and temperature,
"auto" where auto_gamma asks for it), with the same defaults, plus the switches that exist only to
measure a technique (pipe_truncate, pipe_fill_rows, action_tolerance). A test counts default
literals of these settings outside this module.
"""
from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, field, fields
from types import SimpleNamespace

from ..codecs import DEFAULT_CODEC, get_codec
from ..control.actions import SIZES
from ..decoding.lookup import hint_applies
from ..decoding.sampling import SamplingParams
from ..decoding.verify import WISV, VerifySettings
from ..control.chaining import ACT_WHILE_VERIFYING, CONFIRM  # when the robot moves while a decision is made
from ..control.link_fallback import LINK_LOSS_ACTIONS

GAMMA_MAX = 64  # the protocol's longest draft
PIPE_DEPTH_MAX = 8  # the pipeline's most blocks in flight

DECODING_MODES = ("ar", "sd", "fsd", "pipe", "pipe+fsd", "auto")  # auto: ar, sd or pipe per decision
QUEUE_POLICIES = ("priority", "fifo", "random")  # the order early exits are pre-drafted in (robot.predraft)


def setting(default, description: str, *, min_value=None, max_value=None, choices: tuple = ()):
    """A settings field: its default, what it means, and its bounds (the node parameter's too)."""
    return field(default=default, metadata={"description": description, "min_value": min_value,
                                            "max_value": max_value, "choices": tuple(choices)})


@dataclass(frozen=True)
class DrafterSettings:
    """Decoding and scheduling settings of the drafter (the drafter node's parameters)."""

    mode: str = setting(
        "auto", "decoding mode: ar (cloud only), sd (edge drafts, cloud verifies), fsd (sd + pre-drafting on "
                "the verifier's streamed early exits; needs a verifier with exit adapters, else it runs as sd), "
                "pipe (PicoSpec pipeline: up to pipe_depth blocks in flight, drafted ahead of their verdicts), "
                "pipe+fsd (the pipeline, whose continuation after a rejection the early exits guessed and the "
                "robot pre-drafted and sent before the verdict; docs/pipeline.md compares the modes), auto (ar, sd "
                "or pipe, chosen before each decision by the path the measured link, compute and acceptance "
                "predict fastest, with gamma and pipe_depth chosen as auto_gamma does)",
        choices=DECODING_MODES)
    gamma: int = setting(4, "draft tokens per verification round (sd, fsd, pipe, pipe+fsd)",
                         min_value=1, max_value=GAMMA_MAX)
    auto_gamma: bool = setting(
        False, "sd: choose gamma every round (ODLD) and sd or cloud ar every decision (AS2) from measured "
               "rounds; pipe: gamma by ODLD and pipe_depth from the measured link and compute; gamma (and "
               "pipe_depth) are then ignored")
    pipe_depth: int = setting(3, "pipe, pipe+fsd: blocks in flight (drafted and sent before the earlier ones' "
                                 "verdicts)", min_value=1, max_value=PIPE_DEPTH_MAX)
    tree: str = setting(
        "none", "sd, pipe, auto: draft token trees instead of chains (lossless; docs/trees.md): none (chains), "
                "auto (grown where the draft is unsure, gamma levels deep, at most tree_nodes nodes; with auto_gamma "
                "or mode auto as deep as the planned draft length) or the nodes per depth, e.g. 2,2,2,1 (sd, pipe "
                "with a fixed gamma); pipe drafts on from each tree's most probable path; not with the split codec, "
                "csqs or wisv")
    tree_nodes: int = setting(10, "tree auto: the most nodes a tree holds", min_value=1, max_value=64)
    max_new_tokens: int = setting(96, "token budget of one decision", min_value=1, max_value=4096)
    temperature: float = setting(0.0, "sampling temperature (0 = greedy)", min_value=0.0)
    # After an unparseable decision the robot has not moved, so the next frame is the same and a
    # greedy model would write the same text again; after a move the navigator gave up as blocked
    # (pushing into something) it would drive on into it.
    resample_temperature: float = setting(
        0.7, "after an unparseable decision (the robot did not move, so a greedy model would repeat it on the "
             "same view) or a move the navigator gave up as blocked by contact (no progress on fresh "
             "odometry), the next decision samples at this temperature if above temperature; 0 = off",
        min_value=0.0)
    seed: int = setting(0, "sampling seed of the first decision (later decisions add their index)")
    codec: str = setting(
        DEFAULT_CODEC, "uplink codec for the draft distribution (edgespec_ros.codecs); every codec is lossless "
                   "but split:k=K (K > 0: a rejection is resampled from the top-K of the target's "
                   "distribution, LOSSY)")
    verify_mode: str = setting(
        "rejection", "rejection (lossless: the target's own output) or wisv (LOSSY: at temperature 0 the "
                     "verifier's decision head keeps draft tokens that differ from the target's where it judges "
                     "the difference harmless, more readily on a poor link; the action clause is always "
                     "verified strictly; needs a verifier with a WISV head)", choices=("rejection", "wisv"))
    wisv_threshold: float = setting(
        0.01, "wisv: keep a mismatched draft token when the head's rejection probability is at most this "
              "(0 = greedy SD exactly); 0.01 is the most permissive threshold whose closed-loop success stayed "
              "within one standard error of greedy SD on wifi-poor and cellular (docs/wisv.md)",
        min_value=0.0, max_value=1.0)
    hidden_upload: str = setting(
        "auto", "wisv: how the drafter's hidden states reach the head: full (with every block), selective "
                "(only those the verifier asks for, one more round trip) or auto (by the measured link)",
        choices=("full", "selective", "auto"))
    predraft_workers: int = setting(4, "fsd: pre-draft worker threads (each drafts the next block for one "
                                       "early exit)", min_value=1, max_value=64)
    client_queue: str = setting("priority", "fsd: order in which received early exits are pre-drafted: "
                                            "priority (most confident first), fifo or random",
                                choices=QUEUE_POLICIES)
    deadline_s: float = setting(8.0, "a decision not verified within this many seconds is replaced by a stop",
                                min_value=0.05)
    retry_interval_s: float = setting(1.0, "pause after a fault before the next decision", min_value=0.01)
    max_frame_age_s: float = setting(1.0, "never decide on a frame older than this", min_value=0.01)
    wait_for_motion: bool = setting(True, "decide again only after the navigator finished the last motion and "
                                          "on a frame captured after it")
    act_while_verifying: str = setting(
        "off", "when the robot moves while a decision is made: off (decide only after the last motion ended, on "
               "a frame captured after it), overlap (begin the next decision while the motion runs, timed so its "
               "verdict lands as the motion ends; the navigator chains the verified action on without a stop), "
               "speculative (overlap, and where the verdict is predicted to come provisional_margin_s later than "
               "the draft finishes the decision, begin the draft's action as a PROVISIONAL motion inside its own "
               "bounds; the verdict confirms it or stops and reverts to the verified action; the decision "
               "committed is still exactly the target's; the draft's action is read from what sd and pipe draft "
               "ahead, so an ar decision has none), confirm (a decision begins while the motion runs, timed to "
               "land as it ends, and is never acted on: where the motion ends the robot decides on a fresh frame "
               "as with off, drafted from that decision's tokens: the blocking loop's decisions, standing still "
               "a verification pass where the two say the same; greedy decisions only)",
        choices=ACT_WHILE_VERIFYING)
    overlap_min_progress: float = setting(
        0.75, "overlap and speculative: begin the next decision no earlier than this share of the running motion (0: as soon "
              "as its predicted latency allows; 1: at the motion's end); a frame captured early in a motion "
              "shows what the last decision saw, and the policy must foresee all of the motion's outcome",
        min_value=0.0, max_value=1.0)
    provisional_margin_s: float = setting(
        1.0, "speculative: begin a provisional motion only when the predicted verdict comes this many seconds "
             "after the draft finished the decision", min_value=0.0)
    motion_wait_timeout_s: float = setting(15.0, "decide anyway when the navigator has not reported for this "
                                                 "long", min_value=0.1)
    finish_on_stop: bool = setting(True, "a verified 'stop' completes the command (no more decisions until "
                                         "the next)")
    max_decisions: int = setting(0, "decisions per command before it is dropped; 0 = unlimited", min_value=0)
    on_link_loss: str = setting(
        "stop", "what the robot does once the link to the verifier is lost (link_loss_faults link faults in a "
                "row: a missed deadline, an unreachable or dropped verifier): stop (stand still until a "
                "reconnect succeeds), retrace (walk back along this command's moves, never past its start, "
                "until the link is back) or draft_only (LOSSY: the draft decides alone, greedy, each decision "
                "labelled draft_only, the navigator's degraded motion profile); reconnects run meanwhile",
        choices=LINK_LOSS_ACTIONS)
    link_loss_faults: int = setting(3, "link faults in a row (each a failed reconnect after the first) that "
                                       "declare the link lost", min_value=1, max_value=100)
    reconnect_backoff_s: float = setting(0.5, "while the link is lost: the first reconnect's wait; it doubles "
                                              "after each failed one", min_value=0.01)
    reconnect_backoff_max_s: float = setting(8.0, "while the link is lost: the longest wait between reconnects",
                                             min_value=0.01)

    def __post_init__(self):
        if self.mode not in DECODING_MODES:
            raise ValueError(f"mode {self.mode!r} is not available; choose one of {', '.join(DECODING_MODES)}")
        for name in ("deadline_s", "retry_interval_s", "max_frame_age_s", "motion_wait_timeout_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        if self.on_link_loss not in LINK_LOSS_ACTIONS:
            raise ValueError(f"on_link_loss {self.on_link_loss!r}: choose one of {', '.join(LINK_LOSS_ACTIONS)}")
        if self.reconnect_backoff_s > self.reconnect_backoff_max_s:
            raise ValueError(f"reconnect_backoff_s ({self.reconnect_backoff_s:g}) must not exceed "
                             f"reconnect_backoff_max_s ({self.reconnect_backoff_max_s:g})")
        if self.max_decisions < 0:
            raise ValueError(f"max_decisions must be >= 0 (0 = unlimited), got {self.max_decisions}")
        for name in ("temperature", "resample_temperature"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be >= 0, got {value!r}")
        if self.verify_mode == "wisv" and self.temperature != 0:
            raise ValueError("verify_mode wisv decides greedy decisions: set temperature 0 (resampled decisions are "
                             "verified losslessly)")
        for f in fields(self):  # every bound a field states (gamma too, which mode auto does not use)
            value, lo, hi = getattr(self, f.name), f.metadata.get("min_value"), f.metadata.get("max_value")
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if (lo is not None and value < lo) or (hi is not None and value > hi):
                raise ValueError(f"{f.name} must be in [{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}], "
                                 f"got {value!r}")
        cfg = self.decode_config(0)  # validates codec, max_new_tokens, the verify mode and threshold
        if self.act_while_verifying == CONFIRM:
            if not hint_applies(cfg.verify_settings(), get_codec(cfg.codec)):
                raise ValueError("act_while_verifying confirm drafts greedy decisions verified greedily: set "
                                 "temperature 0 and a verify_mode other than wisv, with a codec other than split "
                                 f"(got temperature {self.temperature:g}, {self.verify_mode}, {self.codec})")

    def verification(self) -> str:
        """How this drafter's decisions are verified, for logs and DecodingStats: "lossless", or
        "LOSSY: ..." naming every setting that makes them differ from the target's own output."""
        lossy = []
        if self.verify_mode == "wisv":
            lossy.append(f"verify_mode wisv, threshold {self.wisv_threshold:g} (greedy decisions)")
        codec = get_codec(self.codec)
        if codec.lossy:
            lossy.append(f"codec {codec.spec} (a rejection resampled from the top-{codec.k} of p)")
        return "LOSSY: " + "; ".join(lossy) if lossy else "lossless"

    def decode_config(self, decision_index: int, resample: bool = False) -> "DecodeConfig":
        """The decoding of decision ``decision_index``; ``resample``: it follows an unparseable or
        blocked one."""
        temperature = max(self.temperature, self.resample_temperature) if resample else self.temperature
        # WISV decides greedy decisions; a sampled one (resampling) is verified losslessly
        verify_mode = self.verify_mode if temperature == 0 else "rejection"
        mode_auto = self.mode == "auto"  # chooses the draft length and depth too (DecodeConfig's None)
        return DecodeConfig(mode=self.mode, gamma=None if mode_auto else "auto" if self.auto_gamma else self.gamma,
                            verify_mode=verify_mode, wisv_threshold=self.wisv_threshold,
                            hidden_upload=self.hidden_upload,
                            max_new_tokens=self.max_new_tokens,
                            params=SamplingParams(temperature), seed=self.seed + decision_index,
                            codec=self.codec, workers=self.predraft_workers, client_queue=self.client_queue,
                            pipe_depth=None if mode_auto else "auto" if self.auto_gamma and self.mode in ("pipe", "pipe+fsd")
                            else self.pipe_depth, tree=self.tree, tree_nodes=self.tree_nodes)


def described_fields(cls=DrafterSettings):
    """(name, default, metadata) of each settings field: what nodes/params.py builds its rows from."""
    return [(f.name, f.default, f.metadata) for f in fields(cls) if f.default is not MISSING]


# the defaults as plain values, for DecodeConfig's fields (DEFAULTS itself validates through DecodeConfig)
_D = SimpleNamespace(**{f.name: f.default for f in fields(DrafterSettings)})


@dataclass
class DecodeConfig:
    """The robot's decoding settings for one decision (the cloud sees only ``verify_settings``);
    every default is ``DEFAULTS``'s."""

    mode: str = _D.mode
    # draft length, or "auto" (sd, pipe, pipe+fsd): from the measured link and compute; None: the
    # default for the mode ("auto" in mode auto, which chooses it, else DEFAULTS.gamma)
    gamma: int | str | None = None
    max_new_tokens: int = _D.max_new_tokens
    params: SamplingParams = field(default_factory=lambda: SamplingParams(_D.temperature))
    seed: int = _D.seed
    verify_mode: str = _D.verify_mode  # or "wisv" (LOSSY: semantic acceptance, decoding.wisv)
    wisv_threshold: float = _D.wisv_threshold  # wisv: keep a mismatch at or below this rejection probability
    hidden_upload: str = _D.hidden_upload  # wisv: "full" (FH), "selective" (SH) or "auto" (by the link)
    action_tolerance: int = 0  # wisv, LOSSY, in process only: size classes a kept draft size word may differ by
    codec: str = _D.codec  # uplink codec spec for q, e.g. "ksqs:k=8,l=32" (edgespec_ros.codecs)
    workers: int = _D.predraft_workers  # fsd, pipe+fsd: pre-draft worker threads
    client_queue: str = _D.client_queue  # fsd: order in which early exits are pre-drafted
    pipe_depth: int | str | None = None  # pipe modes: blocks in flight, or "auto"; None: as gamma
    # pipe modes: when the verifier has nothing left to verify, send the block being drafted as it is
    # (latency-aware truncation: the cloud verifies the sub-block drafted so far); off only to measure it
    pipe_truncate: bool = True
    # pipe modes: a block that continues a chained block (the verifier feeds it with no pending token)
    # carries gamma + 1 drafts, so its pass computes the same gamma + 1 rows as a block after a
    # verdict (and as SD's); off only to measure it
    pipe_fill_rows: bool = True
    # sd, pipe: "none" (chains), "auto" or widths per depth "2,2,1"; in process also a decoding.tree.TreeShape
    tree: object = _D.tree
    tree_nodes: int = _D.tree_nodes  # tree "auto": the node budget

    def __post_init__(self):
        if self.mode not in DECODING_MODES:
            raise ValueError(f"unknown decoding mode {self.mode!r}; expected one of {DECODING_MODES}")
        if self.gamma is None:
            self.gamma = "auto" if self.mode == "auto" else _D.gamma
        if self.pipe_depth is None:
            self.pipe_depth = "auto" if self.mode == "auto" else _D.pipe_depth
        if self.gamma == "auto":
            if self.mode == "fsd":
                raise ValueError("gamma 'auto' is for the sd and pipe modes; give fsd an integer gamma")
        elif isinstance(self.gamma, bool) or not isinstance(self.gamma, int) or not 1 <= self.gamma <= GAMMA_MAX:
            raise ValueError(f"gamma (draft length) must be in 1..{GAMMA_MAX} or 'auto', got {self.gamma!r}")
        if self.mode == "auto" and self.gamma != "auto":
            raise ValueError("mode auto chooses the draft length too: give gamma 'auto'")
        if self.pipe_depth != "auto" and (isinstance(self.pipe_depth, bool) or not isinstance(self.pipe_depth, int)
                                          or not 1 <= self.pipe_depth <= PIPE_DEPTH_MAX):
            raise ValueError(f"pipe_depth (blocks in flight) must be in 1..{PIPE_DEPTH_MAX} or 'auto', "
                             f"got {self.pipe_depth!r}")
        get_codec(self.codec)  # raises on an unknown name or a bad parameter
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.client_queue not in QUEUE_POLICIES:
            raise ValueError(f"client_queue must be one of {QUEUE_POLICIES}, got {self.client_queue!r}")
        if not 1 <= self.workers <= 64:
            raise ValueError(f"workers (pre-draft threads) must be in 1..64, got {self.workers}")
        from ..decoding.wisv import UPLOADS
        if self.hidden_upload not in UPLOADS:
            raise ValueError(f"hidden_upload must be one of {UPLOADS}, got {self.hidden_upload!r}")
        if self.action_tolerance and self.verify_mode != WISV:
            raise ValueError("action_tolerance is part of verify mode wisv (LOSSY)")
        if self.verify_mode == WISV and get_codec(self.codec).separate:
            raise ValueError("verify mode wisv decides at the verifier: not with the split codec")
        self.verify_settings()  # raises on a bad verify mode, threshold, or wisv at temperature > 0
        self.tree_shape()  # raises on a bad tree, or one these settings cannot draft

    def tree_shape(self):
        """The decision's ``decoding.tree.TreeShape`` (None: chains); ValueError naming what a tree
        cannot be drafted with."""
        if self.tree == "none" or self.mode == "ar":  # ar drafts nothing (as it ignores gamma)
            return None
        from ..decoding.tree import TreeShape
        depth = self.gamma if isinstance(self.gamma, int) and not isinstance(self.gamma, bool) else _D.gamma
        if isinstance(self.tree, TreeShape):  # in process: any shape (e.g. one level of siblings)
            shape = self.tree
        else:
            try:
                shape = TreeShape.parse(self.tree, depth=depth, budget=max(self.tree_nodes, depth))
            except ValueError as exc:
                raise ValueError(f"tree {self.tree!r}: {exc}") from None
        if self.mode not in ("sd", "pipe", "auto"):
            raise ValueError(f"tree drafts run in modes sd, pipe and auto (mode {self.mode} pre-drafts on a chain's "
                             "verdict); set tree none, or another mode")
        if self.gamma == "auto" and not shape.is_dynamic:
            raise ValueError(f"tree {self.tree!r} is a fixed shape: give an integer gamma, or with gamma auto (and in "
                             "mode auto) tree auto, whose depth is the planned draft length")
        codec = get_codec(self.codec)
        if codec.separate or codec.name == "csqs":
            raise ValueError(f"tree drafts are not valid with codec {codec.spec} (the split codec resamples a chain's "
                             "rejection; csqs budgets bits per chain): use a chain or another codec")
        if self.verify_mode == WISV:
            raise ValueError("tree drafts are verified losslessly: not with verify mode wisv")
        from ..decoding.verifier import MAX_BLOCK
        if shape.nodes > MAX_BLOCK:
            raise ValueError(f"tree {self.tree!r} has {shape.nodes} nodes; a block holds at most {MAX_BLOCK}")
        return shape

    def verify_settings(self) -> VerifySettings:
        wisv = self.verify_mode == WISV
        tolerance = self.action_tolerance if wisv else 0
        # A greedy decision's rejection sampling is the argmax rule exactly (p and q one-hot: a draft
        # is accepted iff it is the target's argmax, the residual is that argmax): verified as
        # greedy, its blocks carry no q (a dense32 q of Qwen2-VL's vocabulary is 607 KB a draft).
        mode = "greedy" if self.verify_mode == "rejection" and self.params.greedy else self.verify_mode
        return VerifySettings(self.params, self.seed, mode, self.wisv_threshold if wisv else 0.0,
                              tolerance, SIZES if tolerance else ())


DEFAULTS = DrafterSettings()  # the shipped settings: bench, demo and training default to these
