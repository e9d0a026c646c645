"""What starts the system: ``demo`` (``edgespec-demo``, ``make demo``), ``closed_loop`` (the closed
loop in one process: the node graph of launch/sim.launch.py with a verifier behind an emulated
link; ``python -m edgespec_ros.bringup``) and ``graph`` (a launch file's node graph in one process,
for the demo and the tests). The verifier and the link proxy run as processes from
``edgespec_ros.processes``, which the benchmarks share."""
