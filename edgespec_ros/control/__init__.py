"""The robot's control end: what a decision's words mean, how the robot moves on them, and what it
does when the link to the verifier fails. ROS-free (no rclpy) and pure where it can be (times and
poses passed in); of the other rooms it imports ``decoding/`` only.

- ``actions``: the action grammar (VLM text <-> motion primitive);
- ``motion``, ``profiles``: running one primitive (the executor, its limits, the degraded profile,
  the outcomes) and its velocity profile in time;
- ``chaining``, ``provisional``: acting while verifying (a queued decision on the running primitive,
  the draft's action begun inside provisional bounds);
- ``retrace``: the way back along a command's moves;
- ``belief``: the search belief's line in a policy's prompt;
- ``driver_watch``: whether the robot's driver still answers;
- ``link_health``, ``link_fallback``: when the link counts as lost and back, and what ``on_link_loss``
  does meanwhile.

Why the link rules live here: this is the one room that the robot (``robot/``, ``nodes/``), the
simulator (``sim/``) and a bag's replay (``rosio/``, which the simulator writes its bags with) may
all import. ``test/test_layout.py`` holds the rules: ``sim/`` imports none of ``robot/``, ``wire/``,
``cloud/`` or ``nodes/``, and ``decoding/`` imports no ``control/``. A rule that the drafter
(``robot.drafter.DrafterCore``), the linked loop (``sim.link_loop``) and the replay must apply alike
is written once, here, and each drives it with its own clock.
"""
