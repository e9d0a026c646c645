"""Fakes for the drafter's decision loop (DrafterCore) without models or ROS: a clock, a decoder
that answers by script, and the helpers that build a core and frames on them."""
import threading

import numpy as np

from edgespec_ros.robot.drafter import DrafterCore, Frame
from edgespec_ros.robot.settings import DrafterSettings
from edgespec_ros.robot.decoder import Decision
from edgespec_ros.decoding.verifier import Verifier
from edgespec_ros.decoding.metrics import DecisionMetrics

S = 1_000_000_000
IMAGE = np.zeros((8, 8, 3), np.uint8)
TEXT = "The silver bottle is ahead. Action: move forward medium."


class Clock:
    def __init__(self, t_ns=100 * S):
        self.t = t_ns

    def __call__(self):
        return self.t

    def advance(self, seconds):
        self.t += int(seconds * S)


class FakeVerifier(Verifier):
    """The verifier of a decoder that decides alone: only closed (counted), never asked to verify."""

    def __init__(self):
        self.closed = 0

    def close(self):
        self.closed += 1

    def start(self, prompt, settings, wait=True):
        raise AssertionError("the fake decoder decides without its verifier")

    submit = receive = verify = generate = start


class FakeDecoder:
    """decide() returns `text` (reporting it as 2 chunks through on_tokens), raises `error`, or blocks on
    `release` (calling on_tokens after release, like the next verified chunk would)."""

    draft = None  # no draft model: a memoryless policy
    auto_gamma = None  # mode auto's controller (EdgeDecoder.auto_gamma): none measured

    def __init__(self, text=TEXT, error=None, block=False, auto=None):
        self.text, self.error = text, error
        self.auto = auto  # mode auto: (the path it takes, its predictions in ms/token), as EdgeDecoder reports
        self.verifier = FakeVerifier()
        self.tokenizer = None
        self.calls = []
        self.temperatures = []
        self.started = threading.Event()
        self.release = threading.Event()
        if not block:
            self.release.set()

    def decide(self, instruction, image, cfg, on_tokens=None):
        self.calls.append((instruction, cfg.seed, cfg.mode))
        self.temperatures.append(cfg.params.temperature)
        self.started.set()
        self.release.wait(10)
        if on_tokens:
            on_tokens([1, 2])
        if self.error is not None:
            raise self.error
        if on_tokens:
            on_tokens([3])
        m = DecisionMetrics(mode=cfg.mode, gamma=cfg.gamma, tokens=12, rounds=4, drafted=16, accepted=8,
                            accepted_per_position=[4, 2, 1, 1], drafted_per_position=[4, 4, 4, 4], wall_s=0.5,
                            t_uplink=0.1, t_downlink=0.1)
        if cfg.mode == "auto" and self.auto:
            m.mode, m.predicted_ms_per_token = self.auto
        return Decision(list(range(12)), self.text, m)


def make(decoder=None, **settings):
    clock = Clock()
    core = DrafterCore(decoder or FakeDecoder(), DrafterSettings(**settings), clock)
    return core, clock


def frame(clock, age_s=0.0):
    return Frame(IMAGE, clock() - int(age_s * S), "cam")


class RememberingDecoder(FakeDecoder):
    """A FakeDecoder whose draft model reads 2 earlier decisions; keeps each prompt's history."""

    def __init__(self, texts):
        super().__init__()
        self.texts, self.histories = list(texts), []
        self.draft = type("Draft", (), {"memory": 2})()

    def decide(self, instruction, image, cfg, on_tokens=None, history=()):
        self.histories.append(history)
        self.text = self.texts[len(self.histories) - 1]
        return super().decide(instruction, image, cfg, on_tokens)


TEXTS = ["Ahead. Action: move forward large.", "Left. Action: turn left small.", "Go. Action: move forward small.",
         "Go. Action: move forward small."]


def first_motion(act_while_verifying, **settings):
    """A core that decided "move forward large" (0.5 s from frame to verdict) and hears it moving,
    predicted to end 3 s later; a fresh frame is there. Returns (core, clock, decoder, out, end_ns)."""
    decoder = RememberingDecoder(TEXTS)
    core, clock = make(decoder, act_while_verifying=act_while_verifying, **settings)
    core.set_command("find the silver bottle")
    core.set_frame(frame(clock))
    ticket = core.begin()
    clock.advance(0.5)
    out = core.run(ticket)
    assert out.action == "move forward large" and not out.chained
    end_ns = clock() + 3 * S
    core.note_motion("moving", out.stamp_ns, clock(), predicted_end_ns=end_ns)
    clock.advance(0.05)
    core.set_frame(frame(clock))
    return core, clock, decoder, out, end_ns
