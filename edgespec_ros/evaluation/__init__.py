"""What drives both halves of the system in process to evaluate it: ``policy`` (a VLM deciding
alone, or speculative decoding with a verifier in process, as the policy deciding in the
simulator's closed loop and the agreement metric) and ``replay`` (a robot decision replayed
offline as speculative rounds of the draft against the target: greedy SD or the WISV rule, for
WISV's labels, its DAgger policies and its evaluation), and ``cli`` (``edgespec-sim``: the
simulator's subcommands beside ``eval`` and ``link-fallbacks``, which decide in it). The simulator,
the robot's loop and the verifier do not import this room; it imports them."""
