"""The prompt while an action is executing (acting while verifying): the prompt after that action
ends "done" but for its outcome word, the belief advanced to where it leaves the robot; and the
prompt with nothing in flight, byte for byte the one the models were trained on."""
from types import SimpleNamespace

import pytest

from edgespec_ros.control.belief import memory_for
from edgespec_ros.decoding.inputs import chat_prompt
from edgespec_ros.decoding.memory import DONE, EXECUTING, Turn, in_flight, outcome_word

INSTRUCTION = "find the red chair and stop next to it"
HISTORY = [("turn left medium", "I see the red chair on my left."), ("move forward large", "The red chair is ahead."),
           ("turn right small", "I don't see the red chair."), ("move forward small", "The red chair is on my right."),
           ("turn left large", ""), ("move forward medium", "the red chair is straight ahead")]


def command_memory(k, belief, decided):
    memory = memory_for(SimpleNamespace(memory=k, belief=belief), INSTRUCTION, command=True)
    for stamp, (action, text) in enumerate(HISTORY[:decided]):
        memory.decided(action, stamp, text)
        memory.motion_reported(stamp, "idle", "completed")
    return memory


def prompt(history):
    return chat_prompt(INSTRUCTION, True, history=history)


@pytest.mark.parametrize("k, belief", [(1, False), (2, True), (3, True), (0, False)])
@pytest.mark.parametrize("decided", range(len(HISTORY)))
def test_the_in_flight_prompt_is_the_completed_one_but_for_its_outcome_word(k, belief, decided):
    action, text = HISTORY[decided]
    running = command_memory(k, belief, decided)
    running.decided(action, 99, text)                   # its motion is under way
    ended = command_memory(k, belief, decided)
    ended.decided(action, 99, text)
    ended.motion_reported(99, "idle", "completed")      # ... and has ended
    shown, after = running.shown_in_flight(), ended.shown()
    if not k:
        assert shown == after == ()
        return
    assert shown[-1].outcome == EXECUTING and after[-1].outcome == DONE
    assert shown[:-1] + (shown[-1]._replace(outcome=DONE),) == after  # belief line included
    assert prompt(shown) == prompt(after[:-1] + (after[-1]._replace(outcome=EXECUTING),))
    assert prompt(shown) != prompt(after)


@pytest.mark.parametrize("k, belief", [(1, False), (3, True)])
def test_with_nothing_in_flight_the_prompt_is_unchanged(k, belief):
    memory = command_memory(k, belief, 4)
    assert prompt(memory.shown_in_flight()) == prompt(memory.shown())
    memory.retracing(50)  # a retrace step is awaited: not remembered, nothing in flight to show
    assert prompt(memory.shown_in_flight()) == prompt(memory.shown())


def test_in_flight_leaves_the_memory_as_it_was():
    memory = command_memory(3, True, 3)
    before, belief = memory.shown(), memory.search.render()
    shown = in_flight(memory, "turn left large", "The red chair is on my left.")
    assert memory.shown() == before and memory.search.render() == belief and len(memory) == 3
    assert shown[-1] == Turn("turn left large", EXECUTING, shown[-1].belief)
    assert "turned left 90, right 15" in shown[-1].belief  # left 30 earlier, 60 more (large) in flight
    with pytest.raises(ValueError):
        outcome_word(EXECUTING)  # a state, never a remembered outcome
