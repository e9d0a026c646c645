"""The simulator expert's wording (``sim.expert``): sentence templates grounded in what a frame
shows (``sim.expert_view``). A seeded rng only picks among equivalent wordings; the action is
decided before and never depends on it. Reasoning never contains the ``Action:`` marker, so every
text parses.
"""
from __future__ import annotations

import math
import random
from typing import Sequence

from ..control.actions import Action
from ..control.motion import wrap_angle
from .expert_view import SeenObject
from .scenario import SceneObject


class ExpertWords:
    """Sentence templates grounded in what is seen; the rng only picks among equivalent wordings."""

    def __init__(self, rng: random.Random, goal: SceneObject, visible: Sequence[SeenObject],
                 ahead_deg: float = 15.0, slight_deg: float = 22.5):
        self.ahead_deg, self.slight_deg = ahead_deg, slight_deg
        self.rng = rng
        self.goal = goal
        self.visible = visible
        self.target = f"the {goal.description}"

    def pick(self, *options: str) -> str:
        return self.rng.choice(options)

    def where(self, seen: SeenObject) -> str:
        degrees = math.degrees(seen.bearing_rad)
        if abs(degrees) <= self.ahead_deg:
            return self.pick("straight ahead", "ahead", "in front of me")
        side = "left" if degrees > 0 else "right"
        if abs(degrees) <= self.slight_deg:
            return self.pick(f"slightly to the {side}", f"a little to the {side}")
        return self.pick(f"on the {side}", f"to my {side}", f"on my {side}")

    def how_far(self, seen: SeenObject) -> str:
        d = seen.distance_m
        if d <= 1.2:
            return self.pick("very close", "close by", "just a short step away")
        if d <= 2.5:
            return self.pick("nearby", "a couple of metres away", "not far away")
        if d <= 4.0:
            return self.pick("a few metres away", "some distance away")
        return self.pick("far away", "in the distance", "far off")

    def distractor(self) -> str | None:
        """A sentence about the first identified look-alike in view (same colour or same type)."""
        goal = self.goal
        for seen in self.visible:
            obj = seen.object
            if not seen.identified or obj.id == goal.id:
                continue
            if obj.color == goal.color and obj.type != goal.type:
                return self.pick(
                    f"I see {_a(obj.description)} {self.where(seen)}, but that is not {_a(goal.type)}.",
                    f"There is {_a(obj.description)} {self.where(seen)}; it is {obj.color} too, "
                    f"but it is {_a(obj.type)}, not {_a(goal.type)}.",
                    f"The {obj.color} object {self.where(seen)} is {_a(obj.type)}, not the {goal.type} I want.")
            if obj.type == goal.type and obj.color != goal.color:
                return self.pick(
                    f"I see {_a(obj.description)} {self.where(seen)}, but it is {obj.color}, not {goal.color}.",
                    f"The {obj.type} {self.where(seen)} is {obj.color}, so it is not the one I am looking for.",
                    f"There is {_a(obj.description)} {self.where(seen)}, but I need the {goal.color} one.")
        return None

    def others(self) -> str | None:
        """A clause listing up to two other identified objects in view."""
        named = [s for s in self.visible if s.object.id != self.goal.id and s.identified][:2]
        if not named:
            return None
        return " and ".join(f"{_a(s.object.description)} {self.where(s)}" for s in named)

    def join(self, *sentences: str | None) -> str:
        return " ".join(s for s in sentences if s)

    def detour_plan(self, target: SeenObject, blocker: SeenObject, action: Action) -> str:
        """What the detour step does, e.g. 'turn right to pass it on the right'."""
        side = "left" if wrap_angle(target.bearing_rad - blocker.bearing_rad) >= 0 else "right"
        if action.kind == "turn":
            return f"turn {action.direction} to pass it on the {side}"
        return self.pick(f"keep going and pass it on the {side}", f"walk on and go around it on the {side}")

    def reached(self, goal: SeenObject) -> str:
        main = self.pick(
            f"I have reached {self.target}; it is {self.where(goal)} and very close.",
            f"{_cap(self.target)} is right here, {self.where(goal)}, close enough to stop.",
            f"I am next to {self.target} now, so the task is done.")
        return self.join(self.distractor(), main)

    def approach(self, goal: SeenObject, action: Action, situation: str, blocker: SeenObject | None) -> str:
        where, far = self.where(goal), self.how_far(goal)
        if situation == "turn":
            turn = action.direction
            main = self.pick(
                f"I see {self.target} {where}, {far}, so I will turn {turn} to face it.",
                f"{_cap(self.target)} is {where}, {far}, so I am turning {turn} to line up with it.",
                f"There is {self.target}, {where} and {far}; I need to turn {turn} towards it.")
        elif situation == "move":
            main = self.pick(
                f"{_cap(self.target)} is {where}, {far}, so I will move forward towards it.",
                f"I can see {self.target} {where}, {far}; moving closer.",
                f"{_cap(self.target)} is {far}, {where}, and I will walk towards it.")
        else:
            assert blocker is not None
            obstacle = f"the {blocker.object.description}"
            go = self.detour_plan(goal, blocker, action)
            main = self.pick(
                f"{_cap(self.target)} is {where}, but {obstacle} is in the way, so I will {go}.",
                f"{_cap(obstacle)} blocks the path to {self.target}; I will {go}.",
                f"I see {self.target} {where}, {far}, with {obstacle} in between; I will {go}.")
        return self.join(self.distractor(), main)

    def inspect(self, candidate: SeenObject, action: Action, situation: str, blocker: SeenObject | None) -> str:
        color, where, goal = self.goal.color, self.where(candidate), self.goal.type
        if blocker is not None:
            plan = f"the {blocker.object.description} is in the way, so I will {self.detour_plan(candidate, blocker, action)}."
        elif action.kind == "turn":
            plan = self.pick(f"I will turn {action.direction} towards it.",
                             f"turning {action.direction} to face it.")
        else:
            plan = self.pick("I will move closer to check.", "moving forward to get a better look.")
        main = self.pick(
            f"There is something {color} {where}, far away, and it could be {self.target}",
            f"I see {_a(color)} object {where} in the distance but cannot tell yet if it is the {goal}",
            f"Something {color} is {where}, too far to make out, and it might be {self.target}")
        return self.join(self.distractor(), f"{main}; {plan}")

    def explore(self, circled: bool = False) -> str:
        """Walking on into open floor; ``circled``: after a full circle without seeing the goal."""
        others = self.others()
        context = (self.pick(f"I see {others}, but no {self.goal.description}.",
                             f"Only {others} here, not {self.target}.") if others else None)
        lead = self.distractor() or context
        if circled:
            main = self.pick(
                f"I have turned all the way around without finding {self.target}, so I will walk on and "
                "search elsewhere.",
                f"A full circle here and no {self.goal.description}; I will move on to look further.")
            return self.join(lead, main)
        main = self.pick(
            f"I don't see {self.target}, and the way ahead is open, so I will move forward to explore.",
            f"{_cap(self.target)} is not in view. The floor ahead is clear; I will walk on and look further.",
            f"No {self.goal.description} in sight. I will go forward into the open space to search.")
        if lead:
            main = self.pick("The way ahead is open, so I will move forward to explore.",
                             "I will walk forward into the open space and keep looking.")
        return self.join(lead, main)

    def recall(self, last_seen: str, direction: str) -> str:
        """Turning back towards where the goal was last seen (``last_seen``: a belief direction).
        The place is said in a sentence without the goal's name, so it is never read back as a
        sighting (``control.belief.seen_bearing``)."""
        where = {"left": "on my left", "right": "on my right", "behind left": "behind me on the left",
                 "behind right": "behind me on the right"}.get(last_seen, "behind me")
        main = self.pick(
            f"{_cap(self.target)} is not in view. I last saw it {where}, so I will turn {direction} to "
            "find it again.",
            f"I no longer see {self.target}. It was {where} before; turning {direction} back towards it.")
        return self.join(self.distractor(), main)

    def with_plan(self, target: SeenObject | None, plan: str) -> str:
        """Where the target is, then what the memory makes the robot do (``plan``: a clause in lower
        case: getting past a blocked move, settling after a reversal); ``target``:
        the goal (identified) or the look-alike being approached, said where it is as the approach
        says it."""
        if target is None:
            return self.join(self.distractor(), _cap(self.target) + " is not in view, and " + plan)
        if target.identified:
            where = f"{_cap(self.target)} is {self.where(target)}, {self.how_far(target)}"
        else:
            where = f"Something {self.goal.color} is {self.where(target)}, too far to make out"
        return self.join(self.distractor(), f"{where}, but {plan}")

    def search(self) -> str:
        turn = "turn left"
        distractor = self.distractor()
        others = self.others()
        if distractor is None and others is not None:
            distractor = self.pick(f"I see {others}, but no {self.goal.description}.",
                                   f"There is {others} here, but not {self.target}.")
        main = self.pick(
            f"I don't see {self.target}, so I will {turn} to look around.",
            f"{_cap(self.target)} is not in view; I will {turn} to search for it.",
            f"No {self.goal.description} in sight yet. I will {turn} and keep looking.")
        if distractor is not None:
            main = self.pick(f"I will {turn} to keep searching for {self.target}.",
                             f"I need to {turn} and keep looking for {self.target}.")
        return self.join(distractor, main)


def _cap(text: str) -> str:
    return text[:1].upper() + text[1:]


def _a(noun_phrase: str) -> str:
    """The noun phrase with its indefinite article: 'a red box', 'an orange cone'."""
    return ("an " if noun_phrase[:1] in "aeiou" else "a ") + noun_phrase
