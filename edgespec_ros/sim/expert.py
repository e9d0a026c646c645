"""The expert: writes what a good VLM should write for a camera frame and an instruction.

The expert knows the true state only to work out what the camera shows (which objects have
pixels in the frame, their bearing and distance); its decision depends on nothing else, so the
action can be inferred from the image and the instruction alone. It is memoryless, like the VLM,
unless ``search_belief`` is set: then step 3 also reads the search belief the prompt shows
(``control.belief``), the one thing beside the image a model with the belief is told; with
``blocked_memory`` step 4 reads the last outcome the prompt's memory shows (``decoding.memory``).

Perception model (what a 112 px camera lets one tell):
- an object with at least ``min_pixels`` pixels in the frame is *seen*; its colour is known;
- its type is known only within ``identify_range_m`` (farther objects are "something silver").

Policy, in order (all geometry from the seen objects and the walls only):
1. The goal is seen and identified: ``stop`` inside the goal radius (or closer, with
   ``stop_gap_m``); otherwise turn to face it when it is more than ``aim_tolerance_deg``
   off-centre, else move forward (the longest size that touches nothing seen and does not pass
   the goal).
2. Something with the goal's colour is seen but too far to identify: approach the nearest such
   object the same way, to have a closer look (the goal itself, or a look-alike distractor).
3. Nothing of interest is seen: walk ahead if the floor ahead is open for at least
   ``explore_clearance_m``, otherwise turn left (``search_turn``) to look around. With
   ``search_belief``: first turn back to where the belief says the goal was last seen (not ahead,
   at most ``recall_decisions`` ago); after a full circle without ever seeing it, walk on where
   the floor is open ``circled_clearance_m``.
4. With ``blocked_memory``, a forward move chosen above right after the prompt showed a forward
   move end ``blocked`` becomes a turn towards the more open side (``unblock_turn``); a turn back
   right after that turn away becomes a walk on past the obstacle where the floor is open.
5. With ``settle_turns``, a turn towards the target right after the memory shows a left/right
   reversal becomes a walk on (the target within ``slight_deg``) or a small turn.

Obstacles: when a seen object blocks the straight line to the target, the robot goes around
it on the target's side. A memoryless robot forgets whatever leaves the frame, so detours keep
both the blocker and the target in view (turning by a metric angle, a multiple of 5 degrees,
when even a small turn would lose one of them) and no move ends where the blocker would block
the way from outside the frame. Moves end ``personal_space_m`` clear of seen objects.

The wording varies with a seeded rng (several templates); the action is a pure function of the
state. Reasoning never contains the ``Action:`` marker, so every text parses.

This module holds the expert's settings (``ExpertConfig``) and its decision rules
(``ExpertPolicy``); what a frame shows it is ``sim.expert_view``, its wording
``sim.expert_words``, its rollouts in a world ``sim.expert_rollout``.
"""
from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass, field, fields
from typing import Sequence

from ..control.actions import DEFAULT_ACTION_CONFIG, SIZES, Action, ActionConfig
from ..control.belief import FULL_CIRCLE_DEG
from ..decoding.memory import BLOCKED, DONE
from ..control.motion import wrap_angle
from .expert_view import SeenObject, of_interest, seen_objects
from .expert_words import ExpertWords
from .render import DEFAULT_CAMERA, CameraConfig, CameraView, render_view
from .scenario import ROBOT_RADIUS_M, Pose, Scenario, SceneObject
from .world import forward_clearance


@dataclass(frozen=True)
class ExpertConfig:
    """Perception and policy knobs of the expert (see the module docstring)."""

    identify_range_m: float = 3.0
    min_pixels: int = 2
    # Drive at a target within this bearing (a small turn is 15 degrees, so a target just outside
    # ends up inside after one); the text calls it "ahead" exactly then, "slightly" left or right
    # up to ``slight_deg`` (turn small; beyond it turns are medium or large).
    aim_tolerance_deg: float = 15.0
    slight_deg: float = 22.5
    search_turn: str = "large"
    # Keep this much air between the robot and anything it drives towards or past.
    clearance_margin_m: float = 0.05
    # Searching: walk ahead when the floor ahead is open at least this far (None: only turn),
    # stopping this far short of what is ahead, so that hidden corners get looked into.
    explore_clearance_m: float | None = 3.0
    explore_stop_short_m: float = 1.5
    # No move ends closer than this to a seen object (beyond touching it), except the target.
    personal_space_m: float = 0.15
    # While going around an obstacle, keep the target at least this far inside the frame edge.
    keep_in_view_margin_deg: float = 10.0
    # Stop (and end the final approach) at most this far from touching the goal, even when the
    # goal radius is larger: a camera shows how close the goal is, not how large the radius is,
    # so a stop rule that follows the radius cannot be learnt near its edge. None: the radius.
    stop_gap_m: float | None = None
    # Turning towards a target off-centre by more than ``aim_tolerance_deg``: None turns by the
    # size closest to its bearing; a size name always turns by that size. One size (medium, for a
    # 90-degree camera) brings any target in the frame back within the tolerance in one turn and
    # removes the small/medium boundary, the decision a camera reads least reliably.
    approach_turn: str | None = None
    # The forward moves an approach may use, longest first among those that fit: fewer sizes put
    # fewer distance boundaries where a small misjudgement of range changes the answer.
    approach_moves: tuple[str, ...] = SIZES
    # A searcher with a memory, for a model that reads the search belief (``control.belief``): while
    # nothing of interest is in view, turn back towards where the goal was last seen (at most
    # ``recall_decisions`` decisions ago, and not ahead), and once it has turned a full circle
    # without ever seeing the goal, walk on wherever the floor is open ``circled_clearance_m``
    # (stopping ``circled_stop_short_m`` short) rather than turning on the spot. It reads the belief
    # only as its prompt line says it, so a model shown the line can learn the same rule; a frame
    # shown without the line is labelled memoryless. False: memoryless throughout.
    search_belief: bool = False
    recall_decisions: int = 3
    circled_clearance_m: float = 1.5
    circled_stop_short_m: float = 0.5
    # An expert that reads the memory's last outcome, for a model with memory (``decoding.memory``):
    # when the prompt shows that the last decision, a forward move, ended ``blocked``, it never
    # answers another forward move (a memoryless expert repeats one into an obstacle its camera no
    # longer shows, and a learner copies the push) but turns by ``unblock_turn`` towards the side
    # whose floor is more open (on a tie, the target's side, else left); and right after that turn
    # it walks on past the obstacle where the floor is open instead of turning straight back into
    # it. It reads the outcomes only as the prompt shows them; a frame shown without its memory is
    # labelled memoryless.
    blocked_memory: bool = False
    unblock_turn: str = "medium"
    # An expert that reads a left/right reversal in the memory, for a model with memory: when the
    # prompt shows the last two decisions as turns in opposite directions (both done) and the
    # expert would turn towards the target again, it walks on when the target is within
    # ``slight_deg`` (and a forward move is safe), else turns ``small`` towards it: a learner that
    # misjudges a bearing swings by medium turns from side to side (a limit cycle) and needs the
    # way out of one shown. A frame shown without its memory is labelled memoryless.
    settle_turns: bool = False

    def __post_init__(self):
        if self.approach_turn is not None and self.approach_turn not in SIZES:
            raise ValueError(f"ExpertConfig.approach_turn: {self.approach_turn!r} is not None or one of {SIZES}")
        if not self.approach_moves or any(s not in SIZES for s in self.approach_moves):
            raise ValueError(f"ExpertConfig.approach_moves: {self.approach_moves!r} must name sizes from {SIZES}")
        for name in ("search_turn", "unblock_turn"):
            if getattr(self, name) not in SIZES:
                raise ValueError(f"ExpertConfig.{name}: {getattr(self, name)!r} is not one of {SIZES}")
        if self.identify_range_m <= 0 or self.min_pixels < 1 or self.aim_tolerance_deg <= 0:
            raise ValueError("ExpertConfig: identify_range_m, min_pixels and aim_tolerance_deg must be positive")
        if self.recall_decisions < 0 or not 0 <= self.circled_stop_short_m < self.circled_clearance_m:
            raise ValueError("ExpertConfig: recall_decisions must be >= 0 and 0 <= circled_stop_short_m < "
                             "circled_clearance_m")


def expert_config_from_pairs(pairs: Sequence[str]) -> ExpertConfig:
    """An :class:`ExpertConfig` from ``KEY=VALUE`` strings (``stop_gap_m=0.3``,
    ``approach_moves=small,large``, ``approach_turn=None``); unknown keys and bad values raise
    ValueError naming them."""
    known = {f.name: f for f in fields(ExpertConfig)}
    values: dict = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or key not in known:
            raise ValueError(f"--expert {pair!r}: expected KEY=VALUE with KEY one of {', '.join(known)}")
        kind = str(known[key].type)
        try:
            if text == "None" and "None" in kind:
                values[key] = None
            elif kind == "bool":
                if text.lower() not in ("true", "false"):
                    raise ValueError(text)
                values[key] = text.lower() == "true"
            elif "tuple" in kind:
                values[key] = tuple(part for part in text.split(",") if part)
            elif "float" in kind:
                values[key] = float(text)
            elif "int" in kind:
                values[key] = int(text)
            else:
                values[key] = text
        except ValueError:
            raise ValueError(f"--expert {pair!r}: {text!r} is not a valid {kind}") from None
    return ExpertConfig(**values)

def expert_overrides(config: ExpertConfig) -> dict:
    """The fields of ``config`` that differ from the default expert, JSON-ready (tuples as lists):
    what a model's training.json records of the expert whose answers it learnt."""
    default = asdict(ExpertConfig())
    return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(config).items() if v != default[k]}


def expert_from_overrides(overrides: dict | None) -> ExpertConfig:
    """The inverse of :func:`expert_overrides` (None or empty: the default expert)."""
    known = {f.name for f in fields(ExpertConfig)}
    unknown = set(overrides or {}) - known
    if unknown:
        raise ValueError(f"expert settings {sorted(unknown)} are not ExpertConfig fields")
    return ExpertConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in (overrides or {}).items()})


@dataclass(frozen=True)
class ExpertDecision:
    """The expert's answer for one frame: ``text`` is ``"<reasoning> Action: <action>."``."""

    action: Action
    reasoning: str
    situation: str
    seen: tuple[SeenObject, ...] = field(default=(), repr=False)

    @property
    def text(self) -> str:
        """The full answer a VLM should produce."""
        return f"{self.reasoning} Action: {self.action.text}."


class ExpertPolicy:
    """Maps (scenario, pose) to an :class:`ExpertDecision`; see the module docstring."""

    def __init__(self, action_config: ActionConfig = DEFAULT_ACTION_CONFIG,
                 camera: CameraConfig = DEFAULT_CAMERA, config: ExpertConfig = ExpertConfig(),
                 seed: int = 0):
        self.action_config = action_config
        self.camera = camera
        self.config = config
        self._rng = random.Random(seed)

    # ------------------------------------------------------------------ perception

    def observe(self, scenario: Scenario, pose: Pose, view: CameraView | None = None) -> tuple[SeenObject, ...]:
        """Objects with at least one pixel in the frame from ``pose`` (rendered if ``view`` is None)."""
        view = render_view(scenario, pose, self.camera) if view is None else view
        return seen_objects(scenario, pose, view, self.config.identify_range_m, self.config.min_pixels)

    # ------------------------------------------------------------------ policy

    def decide(self, scenario: Scenario, pose: Pose, view: CameraView | None = None,
               belief=None, history: Sequence = ()) -> ExpertDecision:
        """The expert's decision for the frame seen from ``pose``; pass ``view`` if already rendered.
        ``belief``: the command's search belief (a ``control.belief.SearchBelief``) as the frame's
        prompt shows it, or None for a frame shown without one; read only with ``search_belief``.
        ``history``: the earlier decisions the frame's prompt shows (``decoding.memory.Turn``s,
        oldest first; empty when shown without memory); read only with ``blocked_memory`` and
        ``settle_turns``."""
        decision = self._decide(scenario, pose, view, belief)
        if not history or decision.action.kind == "stop":
            return decision
        if self.config.blocked_memory:
            if decision.action.kind == "move" and _blocked_move(history[-1]):
                return self._unblock(scenario, pose, decision)
            if (decision.action.kind == "turn" and len(history) >= 2 and _blocked_move(history[-2])
                    and history[-1].outcome == DONE and history[-1].action.startswith("turn")
                    and decision.action.direction not in history[-1].action.split()):
                return self._sidestep(scenario, pose, decision)
        if self.config.settle_turns and decision.situation in ("turn", "inspect-turn") and reversed_turns(history):
            return self._settle(scenario, pose, decision)
        return decision

    def _settle(self, scenario: Scenario, pose: Pose, decision: ExpertDecision) -> ExpertDecision:
        """Instead of ``decision`` (a turn towards the target) right after the memory shows a
        left/right reversal: walk on when the target is within ``slight_deg`` and a forward move is
        safe, else turn ``small`` towards it; ``decision`` when that is what it already does."""
        target, words = self._target_words(scenario, decision)
        if target is None:
            return decision
        action = None
        if abs(math.degrees(target.bearing_rad)) <= self.config.slight_deg:
            action, _ = self._safe_move(scenario, pose, target, decision.seen, final=decision.situation == "turn")
        if action is None:
            action = Action.turn("left" if target.bearing_rad > 0 else "right", "small", self.action_config)
        if action == decision.action:
            return decision
        if action.kind == "move":
            plan = words.pick("I have just turned one way and then the other, and it is nearly straight ahead, "
                              "so I will walk towards it instead of turning again.",
                              "after turning back and forth I am close enough to facing it; moving forward.")
        else:
            plan = words.pick(f"I have just turned one way and then the other, so I will turn {action.direction} "
                              "only a little.",
                              f"after turning back and forth I will make a small turn {action.direction} this time.")
        return self._decision(action, words.with_plan(target, plan), "settle", decision.seen)

    def _unblock(self, scenario: Scenario, pose: Pose, decision: ExpertDecision) -> ExpertDecision:
        """Instead of ``decision`` (a forward move) right after a forward move that ended blocked:
        turn by ``unblock_turn`` towards the side whose floor is more open once turned (walls and
        every object: the body is touching something the camera may no longer show)."""
        angle = math.radians(self.action_config.turn_angle_deg(self.config.unblock_turn))
        open_m = {side: forward_clearance(scenario, Pose(pose.x, pose.y, pose.yaw_rad + sign * angle))[0]
                  for side, sign in (("left", 1.0), ("right", -1.0))}
        target, words = self._target_words(scenario, decision)
        if abs(open_m["left"] - open_m["right"]) > 0.05:
            direction = max(open_m, key=open_m.get)
        elif target is not None:
            direction = "left" if target.bearing_rad >= 0 else "right"
        else:
            direction = "left"
        action = Action.turn(direction, self.config.unblock_turn, self.action_config)
        plan = words.pick(f"my last move was blocked, so I will turn {direction} to get around what is in the way.",
                          f"something stopped my last move, so I am turning {direction} to find a way past it.")
        return self._decision(action, words.with_plan(target, plan), "unblock", decision.seen)

    def _sidestep(self, scenario: Scenario, pose: Pose, decision: ExpertDecision) -> ExpertDecision:
        """Instead of ``decision`` (a turn back) right after turning away from a blocked forward
        move: walk on the longest move the open floor ahead allows, past what blocked it, before
        turning back (else the turn back faces the same obstacle again); ``decision`` when not
        even a small move fits."""
        clearance, _ = forward_clearance(scenario, pose)
        fits = [s for s in reversed(SIZES)
                if self.action_config.move_distance_m(s) <= clearance - self.config.clearance_margin_m]
        if not fits:
            return decision
        target, words = self._target_words(scenario, decision)
        plan = words.pick("I have turned away from what stopped me and the floor ahead is open, so I will walk on "
                          "past it.",
                          "the way ahead is clear now that I have turned away from the obstacle; walking on to get "
                          "around it.")
        action = Action.move_forward(fits[0], self.action_config)
        return self._decision(action, words.with_plan(target, plan), "sidestep", decision.seen)

    def _target_words(self, scenario: Scenario, decision: ExpertDecision) -> tuple[SeenObject | None, ExpertWords]:
        """What ``decision``'s frame shows of interest (the identified goal, else the nearest
        look-alike of its colour, else None) and the wording for the frame."""
        visible, goal_seen, candidate = of_interest(scenario, decision.seen, self.config.min_pixels)
        words = ExpertWords(self._rng, scenario.goal_object, visible, self.config.aim_tolerance_deg, self.config.slight_deg)
        return goal_seen or candidate, words

    def _decide(self, scenario: Scenario, pose: Pose, view: CameraView | None, belief) -> ExpertDecision:
        seen = self.observe(scenario, pose, view)
        visible, goal_seen, target = of_interest(scenario, seen, self.config.min_pixels)
        words = ExpertWords(self._rng, scenario.goal_object, visible, self.config.aim_tolerance_deg, self.config.slight_deg)
        if goal_seen is not None:
            if goal_seen.distance_m <= self.stop_distance(scenario):
                return self._decision(Action.stop(), words.reached(goal_seen), "stop", seen)
            action, situation, blocker = self._approach(scenario, pose, goal_seen, seen, final=True)
            return self._decision(action, words.approach(goal_seen, action, situation, blocker), situation, seen)
        if target is not None:
            action, situation, blocker = self._approach(scenario, pose, target, seen, final=False)
            return self._decision(action, words.inspect(target, action, situation, blocker),
                                  "inspect-" + situation, seen)
        circled = False
        if belief is not None and self.config.search_belief:
            last_seen = belief.last_seen()
            if last_seen not in (None, "ahead") and belief.since_seen <= self.config.recall_decisions:
                direction = "right" if last_seen.endswith("right") else "left"
                action = Action.turn(direction, self.config.search_turn, self.action_config)
                return self._decision(action, words.recall(last_seen, direction), "recall", seen)
            circled = last_seen is None and belief.turned_deg() >= FULL_CIRCLE_DEG
        explore = (self._explore_move(scenario, pose, seen, self.config.circled_clearance_m,
                                      self.config.circled_stop_short_m) if circled else
                   self._explore_move(scenario, pose, seen))
        if explore is not None:
            return self._decision(explore, words.explore(circled), "explore-circled" if circled else "explore", seen)
        action = Action.turn("left", self.config.search_turn, self.action_config)
        return self._decision(action, words.search(), "search", seen)

    def _explore_move(self, scenario: Scenario, pose: Pose, seen: Sequence[SeenObject],
                      threshold: float | None = None, stop_short_m: float | None = None) -> Action | None:
        """A forward move into open floor when nothing of interest is seen, or None to turn instead
        (``threshold``, ``stop_short_m``: the config's ``explore_*`` unless given)."""
        if threshold is None:
            threshold = self.config.explore_clearance_m
        if stop_short_m is None:
            stop_short_m = self.config.explore_stop_short_m
        if threshold is None:
            return None
        clearance, _ = forward_clearance(scenario, pose, [s.object for s in seen])
        if clearance < threshold:
            return None
        c, s_ = math.cos(pose.yaw_rad), math.sin(pose.yaw_rad)
        for size in reversed(SIZES):
            distance = self.action_config.move_distance_m(size)
            ex, ey = pose.x + distance * c, pose.y + distance * s_
            if (distance <= clearance - stop_short_m
                    and not any(self._too_close(ex, ey, o.object) for o in seen)):
                return Action.move_forward(size, self.action_config)
        return None

    def _decision(self, action: Action, reasoning: str, situation: str, seen) -> ExpertDecision:
        return ExpertDecision(action, reasoning, situation, tuple(seen))

    def _approach(self, scenario: Scenario, pose: Pose, target: SeenObject,
                  seen: Sequence[SeenObject], final: bool) -> tuple[Action, str, SeenObject | None]:
        """Turn towards or drive at ``target``, around the nearest seen object blocking the way.
        Returns (action, situation, blocker) with situation in turn/move/detour-turn/detour-move.

        Going around an obstacle must work without memory, so every frame of a detour shows both
        the target and the blocker: the robot turns only as far as keeps both in the frame, then
        drives past the blocker while it is still in view. From outside the blocker's detour
        radius (see :meth:`_detour_radius`) a blocker is always in the frame when facing the
        target, and no move ends inside that radius while the blocker still blocks the way.
        """
        tolerance = math.radians(self.config.aim_tolerance_deg)
        keep = self._keep_in_view_rad()
        others = [s for s in seen if s.index != target.index]
        blocker = self._blocker(pose.x, pose.y, target, others)
        if blocker is None and abs(target.bearing_rad) > tolerance:
            if self.config.approach_turn is not None:
                direction = "left" if target.bearing_rad > 0 else "right"
                return Action.turn(direction, self.config.approach_turn, self.action_config), "turn", None
            return self._turn_towards(target.bearing_rad), "turn", None
        if blocker is None or abs(target.bearing_rad) <= keep:
            move, crowding = self._safe_move(scenario, pose, target, seen, final)
            if move is not None:
                return move, ("move" if blocker is None else "detour-move"), blocker
            blocker = blocker or crowding
            if blocker is None:  # a wall right ahead: turn towards the target's side
                direction = "left" if target.bearing_rad >= 0 else "right"
                return Action.turn(direction, "medium", self.action_config), "turn", None
        turn = self._detour_turn(target, blocker)
        if turn is not None:
            return turn, "detour-turn", blocker
        # Facing the widest berth that keeps both in view, but every move ends where the blocker
        # would drop out of view while still in the way: brush past it anyway (collision-free).
        move, _ = self._safe_move(scenario, pose, target, seen, final, keep_blockers_in_view=False)
        if move is not None:
            return move, "detour-move", blocker
        side = "left" if wrap_angle(target.bearing_rad - blocker.bearing_rad) >= 0 else "right"
        return Action.turn(side, "small", self.action_config), "detour-turn", blocker

    def stop_distance(self, scenario: Scenario) -> float:
        """How close to the goal's centre the expert stops: the goal radius, or less with
        ``stop_gap_m`` (never less than touching distance plus twice the clearance margin)."""
        radius = scenario.goal.radius_m
        if self.config.stop_gap_m is None:
            return radius
        touching = scenario.goal_object.footprint_radius_m + ROBOT_RADIUS_M
        return min(radius, max(touching + self.config.stop_gap_m, touching + 2 * self.config.clearance_margin_m))

    def _keep_in_view_rad(self) -> float:
        return self.camera.half_hfov_rad - math.radians(self.config.keep_in_view_margin_deg)

    def _detour_turn(self, target: SeenObject, blocker: SeenObject) -> Action | None:
        """Turn towards a heading that clears ``blocker`` on the target's side of it, no farther
        than keeps both the blocker and the target in the frame; None when already facing it."""
        keep = self._keep_in_view_rad()
        b, bo = target.bearing_rad, blocker.bearing_rad
        side = 1.0 if wrap_angle(b - bo) >= 0 else -1.0
        clear = math.asin(min(1.0, self._block_radius(blocker.object) / max(blocker.distance_m, 1e-6)))
        wanted = wrap_angle(bo + side * (clear + math.radians(5.0)))
        low, high = max(bo, b) - keep, min(bo, b) + keep
        heading = min(max(wanted, low), high)
        if abs(heading) < math.radians(2.0):
            return None  # already facing the best heading that keeps both in view
        # Turn by the size closest to the wanted angle among those that keep both in view.
        limit = high if heading > 0 else -low
        return self._turn_towards(heading, max_turn_rad=limit)

    def _block_radius(self, obj: SceneObject) -> float:
        """Robot centres closer than this to ``obj`` (plus the margin) touch it."""
        return obj.footprint_radius_m + ROBOT_RADIUS_M + self.config.clearance_margin_m

    def _detour_radius(self, obj: SceneObject) -> float:
        """From farther than this, an obstacle blocking the line to the target lies within
        (half FOV - keep_in_view_margin) of the target's direction, i.e. in the frame."""
        return self._block_radius(obj) / math.sin(self._keep_in_view_rad())

    def _blocks(self, x: float, y: float, target: SeenObject, obj: SceneObject) -> bool:
        """Does ``obj`` block the straight line from (x, y) to the target?"""
        vx, vy = target.object.x - x, target.object.y - y
        length = math.hypot(vx, vy)
        if length < 1e-9:
            return False
        ox, oy = obj.x - x, obj.y - y
        along = (ox * vx + oy * vy) / length
        across = abs(ox * vy - oy * vx) / length
        return 0.0 < along < length and across < self._block_radius(obj)

    def _hidden_blocker_at(self, x: float, y: float, target: SeenObject, obj: SceneObject) -> bool:
        """Would ``obj`` block the line from (x, y) to the target while lying outside the frame
        of a robot there facing the target? (Such a position would make the robot forget it.)"""
        return (math.hypot(obj.x - x, obj.y - y) < self._detour_radius(obj)
                and self._blocks(x, y, target, obj))

    def _too_close(self, x: float, y: float, obj: SceneObject) -> bool:
        """Would a robot at (x, y) stand closer to ``obj`` than the personal-space margin?"""
        reach = obj.footprint_radius_m + ROBOT_RADIUS_M + self.config.personal_space_m
        return math.hypot(obj.x - x, obj.y - y) < reach

    def _blocker(self, x: float, y: float, target: SeenObject,
                 others: Sequence[SeenObject]) -> SeenObject | None:
        """The nearest seen object that blocks the straight line from (x, y) to the target."""
        blocking = [o for o in others if self._blocks(x, y, target, o.object)]
        return min(blocking, key=lambda o: o.distance_m) if blocking else None

    def _safe_move(self, scenario: Scenario, pose: Pose, target: SeenObject,
                   seen: Sequence[SeenObject], final: bool,
                   keep_blockers_in_view: bool = True) -> tuple[Action | None, SeenObject | None]:
        """The longest forward move that touches nothing seen, does not pass the target, and
        does not end inside the detour radius of an object still blocking the way; with no such
        move, (None, the object that ruled the moves out, or None for a wall)."""
        cfg = self.config
        reach_target = target.object.footprint_radius_m + ROBOT_RADIUS_M
        clearance, _ = forward_clearance(scenario, pose, [s.object for s in seen])
        along_target = target.distance_m * math.cos(target.bearing_rad)
        if final:
            # Inside the stop distance but outside the collision distance is where we want to end.
            margin = min(cfg.clearance_margin_m, (self.stop_distance(scenario) - reach_target) / 2.0)
            limit = min(clearance - margin, along_target - 0.1)
        else:
            limit = min(clearance - cfg.clearance_margin_m, along_target - reach_target)
        sizes: list[str | float] = [s for s in reversed(SIZES) if s in cfg.approach_moves
                                    and self.action_config.move_distance_m(s) <= limit + 1e-9]
        if not sizes and limit >= 0.05:
            sizes = [math.floor(limit * 20.0) / 20.0]
        others = [s for s in seen if s.index != target.index]
        crowding = None
        c, s_ = math.cos(pose.yaw_rad), math.sin(pose.yaw_rad)
        for size in sizes:
            distance = self.action_config.move_distance_m(size) if isinstance(size, str) else size
            ex, ey = pose.x + distance * c, pose.y + distance * s_
            if final and math.hypot(target.object.x - ex, target.object.y - ey) <= self.stop_distance(scenario):
                return Action.move_forward(size, self.action_config), None
            crowded = [o for o in others
                       if (keep_blockers_in_view and self._hidden_blocker_at(ex, ey, target, o.object))
                       or self._too_close(ex, ey, o.object)]
            if not crowded:
                return Action.move_forward(size, self.action_config), None
            crowding = crowding or min(crowded, key=lambda o: o.distance_m)
        return None, crowding

    def _turn_towards(self, heading_rad: float, max_turn_rad: float = math.inf) -> Action:
        """Turn by the size closest to ``heading_rad``, among sizes no larger than ``max_turn_rad``;
        a metric turn (whole multiples of 5 degrees) when even the small size is too large."""
        direction = "left" if heading_rad > 0 else "right"
        magnitude = math.degrees(abs(heading_rad))
        allowed = [s for s in SIZES if self.action_config.turn_angle_deg(s) <= math.degrees(max_turn_rad) + 1e-9]
        if allowed:
            size = min(allowed, key=lambda s: abs(self.action_config.turn_angle_deg(s) - magnitude))
            return Action.turn(direction, size, self.action_config)
        degrees = max(5.0, 5.0 * math.floor(min(magnitude, math.degrees(max_turn_rad)) / 5.0))
        return Action.turn(direction, degrees, self.action_config)


def reversed_turns(history: Sequence) -> bool:
    """Does the memory (``decoding.memory.Turn``s, oldest first) end with two turns in opposite
    directions, both done: one step of a left/right limit cycle?"""
    if len(history) < 2:
        return False
    words = [t.action.split() for t in history[-2:]]
    return (all(t.outcome == DONE for t in history[-2:]) and all(len(w) >= 2 and w[0] == "turn" for w in words)
            and words[0][1] != words[1][1])


def _blocked_move(turn) -> bool:
    """Did this remembered decision (a ``decoding.memory.Turn``) move forward and end blocked?"""
    return turn.outcome == BLOCKED and turn.action.startswith("move")
