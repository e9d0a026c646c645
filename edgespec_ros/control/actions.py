"""The action grammar: the one place where VLM text becomes a motion primitive and back.

A VLM writes reasoning, then one ``Action: <action>.`` clause. The actions are::

    move forward small|medium|large        move forward 0.75 m   (m, meter(s), metre(s))
    turn left|right small|medium|large      turn left 30 degrees  (deg, degree(s), °)
    stop

Sizes resolve to metres and radians through an :class:`ActionConfig`, so the simulator's
expert, the navigator and the tests all agree on what "move forward medium" means. Angles are
signed CCW: a left turn has a positive ``angle_rad``.
"""
from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping

SIZES = ("small", "medium", "large")
ACTION_KINDS = ("move", "turn", "stop")
TURN_DIRECTIONS = ("left", "right")
DISTANCE_UNITS = frozenset({"m", "meter", "meters", "metre", "metres"})
ANGLE_UNITS = frozenset({"deg", "degree", "degrees", "°"})

# "Action:" opens the action clause of a full VLM answer; matched case-insensitively.
_ACTION_MARKER = re.compile(r"\baction\s*:", re.IGNORECASE)
# Tokens of an action phrase: signed decimal numbers, words, the degree sign, any other symbol.
_TOKEN = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)|[a-z]+|°|\S")
_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)")
_NON_FINITE_WORDS = frozenset({"nan", "inf", "infinity"})
_QUOTES = "\"'`*"


class ActionParseError(ValueError):
    """Text is not exactly one valid action; ``reason`` says why in words a person can act on."""

    def __init__(self, reason: str, text: str | None = None):
        self.reason = reason
        self.text = text
        if text is None:
            super().__init__(reason)
        else:
            shown = text if len(text) <= 80 else text[:77] + "..."
            super().__init__(f"{reason} (in {shown!r})")


def check_positive_fields(config) -> None:
    """Every field of the dataclass ``config`` is a positive finite number (not a bool), or
    ValueError naming the class and the field."""
    name = type(config).__name__
    for f in fields(config):
        value = getattr(config, f.name)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{name}.{f.name}: expected a number, got {value!r}")
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"{name}.{f.name}: must be a positive finite number, got {value!r}")


@dataclass(frozen=True)
class ActionConfig:
    """What the sizes mean in metres and degrees, and the largest metric action accepted."""

    move_small_m: float = 0.25
    move_medium_m: float = 0.5
    move_large_m: float = 1.0
    turn_small_deg: float = 15.0
    turn_medium_deg: float = 30.0
    turn_large_deg: float = 60.0
    max_move_m: float = 2.0
    max_turn_deg: float = 180.0

    def __post_init__(self):
        check_positive_fields(self)
        for unit, limit in (("m", "max_move_m"), ("deg", "max_turn_deg")):
            prefix = "move" if unit == "m" else "turn"
            small, medium, large = (getattr(self, f"{prefix}_{s}_{unit}") for s in SIZES)
            if not small < medium < large:
                raise ValueError(
                    f"ActionConfig.{prefix}_*_{unit}: sizes must grow small < medium < large, "
                    f"got {small}, {medium}, {large}")
            if large > getattr(self, limit):
                raise ValueError(
                    f"ActionConfig.{limit}: {getattr(self, limit)} is below "
                    f"{prefix}_large_{unit} = {large}; raise the limit or shrink the size")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "ActionConfig":
        """Build a config from a mapping of field names to numbers; unknown keys are rejected."""
        if not isinstance(values, Mapping):
            raise ValueError(f"ActionConfig: expected a mapping, got {type(values).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(
                f"ActionConfig: unknown key(s) {unknown}; known keys are {sorted(known)}")
        return cls(**dict(values))

    def to_dict(self) -> dict[str, float]:
        """The config as a plain dict, accepted back by :meth:`from_dict`."""
        return asdict(self)

    def move_distance_m(self, size: str) -> float:
        """Metres travelled by ``move forward <size>``."""
        _check_size(size)
        return getattr(self, f"move_{size}_m")

    def turn_angle_deg(self, size: str) -> float:
        """Unsigned degrees turned by ``turn left|right <size>``."""
        _check_size(size)
        return getattr(self, f"turn_{size}_deg")


DEFAULT_ACTION_CONFIG = ActionConfig()


@dataclass(frozen=True)
class Action:
    """One motion primitive.

    ``kind`` is move, turn or stop; ``direction`` is forward (move), left/right (turn) or None
    (stop); ``size`` is small/medium/large, or None for metric actions and stop.
    ``distance_m`` >= 0 is the forward travel, ``angle_rad`` the signed CCW turn (left > 0).
    """

    kind: str
    direction: str | None = None
    size: str | None = None
    distance_m: float = 0.0
    angle_rad: float = 0.0

    def __post_init__(self):
        if self.kind == "stop":
            ok = self.direction is None and self.size is None and self.distance_m == 0 and self.angle_rad == 0
        elif self.kind == "move":
            ok = (self.direction == "forward" and self.size in (None, *SIZES)
                  and math.isfinite(self.distance_m) and self.distance_m > 0 and self.angle_rad == 0)
        elif self.kind == "turn":
            sign_ok = (self.angle_rad > 0) if self.direction == "left" else (self.angle_rad < 0)
            ok = (self.direction in TURN_DIRECTIONS and self.size in (None, *SIZES)
                  and math.isfinite(self.angle_rad) and sign_ok and self.distance_m == 0)
        else:
            ok = False
        if not ok:
            raise ValueError(f"inconsistent Action {self!r}; build actions with parse_action(), "
                             "Action.move_forward(), Action.turn() or Action.stop()")

    @classmethod
    def stop(cls) -> "Action":
        """The stop action."""
        return cls("stop")

    @classmethod
    def move_forward(cls, amount: str | float, config: ActionConfig = DEFAULT_ACTION_CONFIG) -> "Action":
        """``move forward <amount>``: a size name, or metres in (0, config.max_move_m]."""
        if isinstance(amount, str):
            return cls("move", "forward", amount, config.move_distance_m(amount), 0.0)
        _check_magnitude(float(amount), "m", config.max_move_m, "max_move_m", "distance")
        return cls("move", "forward", None, float(amount), 0.0)

    @classmethod
    def turn(cls, direction: str, amount: str | float,
             config: ActionConfig = DEFAULT_ACTION_CONFIG) -> "Action":
        """``turn <direction> <amount>``: direction left/right; a size name, or degrees in (0, max_turn_deg]."""
        if direction not in TURN_DIRECTIONS:
            raise ValueError(f"turn direction {direction!r} is not one of {TURN_DIRECTIONS}")
        sign = 1.0 if direction == "left" else -1.0
        if isinstance(amount, str):
            return cls("turn", direction, amount, 0.0, sign * math.radians(config.turn_angle_deg(amount)))
        _check_magnitude(float(amount), "degrees", config.max_turn_deg, "max_turn_deg", "angle")
        return cls("turn", direction, None, 0.0, sign * math.radians(float(amount)))

    @property
    def is_metric(self) -> bool:
        """True for ``move forward 0.75 m`` / ``turn left 30 degrees`` style actions."""
        return self.kind != "stop" and self.size is None

    @property
    def angle_deg(self) -> float:
        """The signed turn in degrees (left > 0)."""
        return math.degrees(self.angle_rad)

    @property
    def text(self) -> str:
        """Canonical text; metric magnitudes are written with 6 significant digits."""
        if self.kind == "stop":
            return "stop"
        if self.kind == "move":
            amount = self.size if self.size else f"{_number_text(self.distance_m)} m"
            return f"move forward {amount}"
        amount = self.size if self.size else f"{_number_text(abs(self.angle_deg))} degrees"
        return f"turn {self.direction} {amount}"

    def to_motion(self) -> tuple[float, float]:
        """``(distance_m, angle_rad)`` the robot should execute: one of them is zero."""
        return self.distance_m, self.angle_rad

    def __str__(self) -> str:
        return self.text


# VerifiedAction.kind: the index here is the message's KIND_* constant (a test keeps them in step).
ACTION_KIND_CODES = ("none", "stop", "move", "turn")


def action_from_fields(kind: str, direction: str = "", size: str = "", distance_m: float = 0.0,
                       angle_rad: float = 0.0, config: ActionConfig = DEFAULT_ACTION_CONFIG) -> Action:
    """The Action a decision message's parsed fields describe, checked as strictly as text:
    ActionParseError names what is wrong (unknown kind, a direction that does not go with it, a
    magnitude that is not finite, not positive or over the config's limit, a size that is not
    small/medium/large). The magnitude is the sender's: a size only names it."""
    if kind not in ACTION_KINDS:
        raise ActionParseError(f"no action (kind {kind!r})" if kind in ("", "none") else f"unknown action kind {kind!r}")
    if size and size not in SIZES:
        raise ActionParseError(f"unknown size {size!r}: use one of {', '.join(SIZES)}")
    distance_m, angle_rad = float(distance_m), float(angle_rad)
    if kind == "stop":
        if direction or size or distance_m or angle_rad:
            raise ActionParseError("a stop has no direction, size, distance or angle")
        return Action.stop()
    if kind == "move":
        if direction != "forward" or angle_rad:
            raise ActionParseError(f"a move goes forward with no angle, got direction {direction!r} angle {angle_rad!r}")
        _check_magnitude(distance_m, "m", config.max_move_m, "max_move_m", "distance")
        return Action("move", "forward", size or None, distance_m, 0.0)
    if direction not in TURN_DIRECTIONS or distance_m:
        raise ActionParseError(f"a turn goes left or right with no distance, got direction {direction!r}")
    _check_magnitude(math.degrees(abs(angle_rad)), "degrees", config.max_turn_deg, "max_turn_deg", "angle")
    if (angle_rad > 0) != (direction == "left"):
        raise ActionParseError(f"turn {direction} with angle {angle_rad!r}: left turns are positive (CCW)")
    return Action("turn", direction, size or None, 0.0, angle_rad)


def format_action(action: Action) -> str:
    """The canonical text of ``action``; ``parse_action(format_action(a)).text == a.text``."""
    return action.text


def split_reasoning_action(text: str) -> tuple[str, str]:
    """Split a VLM answer into ``(reasoning, action_text)`` around its one ``Action:`` marker.

    Without a marker the reasoning is empty and the whole stripped text is the action text.
    Raises ActionParseError when the text is not a string or has more than one marker.
    """
    if not isinstance(text, str):
        raise ActionParseError(f"expected text, got {type(text).__name__}")
    markers = list(_ACTION_MARKER.finditer(text))
    if len(markers) > 1:
        raise ActionParseError(
            f"found {len(markers)} 'Action:' clauses; the answer must contain exactly one", text)
    if not markers:
        return "", text.strip()
    marker = markers[0]
    return text[:marker.start()].strip(), text[marker.end():].strip()


def completed_action(text: str, config: ActionConfig = DEFAULT_ACTION_CONFIG) -> Action | None:
    """The action of an answer still being written (a draft's text drafted ahead of its verdict),
    once its ``Action:`` clause is complete: the marker, then an action closed by its period. None
    before that, and for anything :func:`parse_action` refuses (never a guess at a cut-off clause:
    "move forward" before its size is not yet an action)."""
    try:
        _, action_text = split_reasoning_action(text)
    except ActionParseError:
        return None
    if not _ACTION_MARKER.search(text) or not action_text.rstrip().endswith("."):
        return None
    try:
        return parse_action(text, config)
    except ActionParseError:
        return None


def parse_action(text: str, config: ActionConfig = DEFAULT_ACTION_CONFIG) -> Action:
    """Parse exactly one action from ``text`` (a bare action or a full reasoning + ``Action:`` answer).

    Case-insensitive, tolerant of extra whitespace and a trailing period. Raises
    ActionParseError (a ValueError) with a human-readable ``reason`` otherwise.
    """
    _, action_text = split_reasoning_action(text)
    phrase = re.sub(r"[\s.]+$", "", " ".join(action_text.lower().split())).strip(_QUOTES).strip()
    phrase = re.sub(r"[\s.]+$", "", phrase)
    if not phrase:
        where = "after 'Action:'" if _ACTION_MARKER.search(text) else "in the text"
        raise ActionParseError(f"no action {where}; expected e.g. 'move forward small', "
                               "'turn left medium' or 'stop'", text)
    tokens = _TOKEN.findall(phrase)
    verb, rest = tokens[0], tokens[1:]
    if verb == "stop":
        action = Action.stop()
    elif verb == "move":
        action, rest = _parse_move(rest, config, text)
    elif verb == "turn":
        action, rest = _parse_turn(rest, config, text)
    else:
        raise ActionParseError(
            f"unknown action {verb!r}; expected 'move forward <size>', "
            "'turn left|right <size>' or 'stop'", text)
    if rest:
        if any(token in ACTION_KINDS for token in rest):
            raise ActionParseError(
                f"more than one action ({action.text!r} followed by {' '.join(rest)!r}); "
                "write exactly one", text)
        raise ActionParseError(f"unexpected words after {action.text!r}: {' '.join(rest)!r}", text)
    return action


def _parse_move(tokens: list[str], config: ActionConfig, text: str) -> tuple[Action, list[str]]:
    if not tokens:
        raise ActionParseError("'move' needs 'forward' and a size, e.g. 'move forward small'", text)
    if tokens[0] != "forward":
        if tokens[0] in ("backward", "backwards", "back", "left", "right"):
            raise ActionParseError(
                f"'move {tokens[0]}' is not supported; the robot only moves forward "
                "(turn first, then 'move forward <size>')", text)
        raise ActionParseError(f"unknown move direction {tokens[0]!r}; expected 'move forward'", text)
    amount, rest = _parse_amount(tokens[1:], "move forward", DISTANCE_UNITS, "m", text)
    if isinstance(amount, str):
        return Action.move_forward(amount, config), rest
    _check_magnitude(amount, "m", config.max_move_m, "max_move_m", "distance", text)
    return Action("move", "forward", None, amount, 0.0), rest


def _parse_turn(tokens: list[str], config: ActionConfig, text: str) -> tuple[Action, list[str]]:
    if not tokens:
        raise ActionParseError("'turn' needs a direction and a size, e.g. 'turn left small'", text)
    direction = tokens[0]
    if direction not in TURN_DIRECTIONS:
        raise ActionParseError(f"unknown turn direction {direction!r}; expected left or right", text)
    amount, rest = _parse_amount(tokens[1:], f"turn {direction}", ANGLE_UNITS, "degrees", text)
    if isinstance(amount, str):
        return Action.turn(direction, amount, config), rest
    _check_magnitude(amount, "degrees", config.max_turn_deg, "max_turn_deg", "angle", text)
    sign = 1.0 if direction == "left" else -1.0
    return Action("turn", direction, None, 0.0, sign * math.radians(amount)), rest


def _parse_amount(tokens: list[str], head: str, units: frozenset[str], unit_hint: str,
                  text: str) -> tuple[str | float, list[str]]:
    """A size word, or a number followed by a unit from ``units``; returns it and the leftover tokens."""
    example = "0.5 m" if unit_hint == "m" else "30 degrees"
    if not tokens:
        raise ActionParseError(f"'{head}' needs a size (small, medium, large) or an amount like "
                               f"'{example}'", text)
    token, rest = tokens[0], tokens[1:]
    if token in SIZES:
        return token, rest
    if _NUMBER.fullmatch(token) or token in _NON_FINITE_WORDS:
        value = float(token)
        if not rest:
            raise ActionParseError(f"missing unit after {token!r}; write e.g. '{head} {example}'", text)
        if rest[0] not in units:
            other = ANGLE_UNITS if units is DISTANCE_UNITS else DISTANCE_UNITS
            kind = "a distance" if units is DISTANCE_UNITS else "an angle"
            if rest[0] in other:
                raise ActionParseError(f"unit {rest[0]!r} is not {kind} unit; '{head}' takes "
                                       f"{unit_hint}, e.g. '{head} {example}'", text)
            raise ActionParseError(f"unknown unit {rest[0]!r} after {token!r}; write e.g. "
                                   f"'{head} {example}'", text)
        return value, rest[1:]
    raise ActionParseError(f"unknown size {token!r} in '{head}'; expected small, medium, large "
                           f"or an amount like '{example}'", text)


def _check_magnitude(value: float, unit: str, limit: float, limit_name: str, what: str,
                     text: str | None = None) -> None:
    if not math.isfinite(value):
        raise ActionParseError(f"{what} {value} is not a finite number", text)
    if value <= 0:
        raise ActionParseError(f"{what} must be positive, got {_number_text(value)} {unit}", text)
    if value > limit:
        raise ActionParseError(f"{what} {_number_text(value)} {unit} exceeds the limit of "
                               f"{_number_text(limit)} {unit} (ActionConfig.{limit_name})", text)


def _check_size(size: str) -> None:
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; expected one of {SIZES}")


def _number_text(value: float) -> str:
    return f"{value:.6g}"
