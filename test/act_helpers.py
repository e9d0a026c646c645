"""The linked loop's fixtures for the acting-while-verifying tests: a corridor with a bottle at its far
end, the link-health rule and motion limits they share, a link cut by hand."""
import math

from edgespec_ros.control.actions import parse_action
from edgespec_ros.control.link_health import LinkHealth
from edgespec_ros.control.motion import MotionLimits
from edgespec_ros.sim.scenario import scenario_from_dict

ROOM = {"name": "corridor", "room": {"width_m": 9.0, "depth_m": 6.0},
        "objects": [{"id": "bottle1", "type": "bottle", "color": "silver", "x": 8.5, "y": 5.5}],
        "robot": {"x": 1.0, "y": 3.0, "yaw_deg": 0.0},
        "instruction": "find the silver bottle", "goal": {"object": "bottle1", "radius_m": 0.7}, "max_steps": 200}
HEALTH = LinkHealth(faults_to_lose=3, backoff_s=0.5, backoff_max_s=8.0)
LIMITS = MotionLimits()
MOVE_M = LIMITS.duration_s(parse_action("move forward medium"))  # 1.5 s
TURN_S = LIMITS.duration_s(parse_action("turn left small"))


def corridor(**robot):
    data = dict(ROOM, robot={**ROOM["robot"], **robot})
    return scenario_from_dict(data)


class CutLink:
    """Up except in [start, end)."""

    rtt_s = 0.0

    def __init__(self, start=math.inf, end=math.inf):
        self.start, self.end = start, end

    def up_at(self, t):
        return not self.start <= t < self.end
