"""``python -m edgespec_ros.bringup``: the closed loop (``closed_loop.main``)."""
import sys

from .closed_loop import main

sys.exit(main())
