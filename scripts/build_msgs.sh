#!/usr/bin/env bash
# Build msg/ (rosidl) from this package's CMakeLists.txt into a venv that holds the ROS 2 PyPI
# wheels (requirements/msgs-build.txt), the same way colcon builds it on the robot.
#
#   scripts/build_msgs.sh VENV                 configure + build + install into VENV
#   scripts/build_msgs.sh VENV --install-only  only rerun `cmake --install` (after `pip install .`
#                                               replaced the Python sources, merge the generated
#                                               edgespec_ros.msg back beside them)
#
# The wheels install a normal ROS prefix into the venv itself ($VENV/share/<pkg>/cmake,
# $VENV/lib/lib*.so), so VENV is both CMAKE_PREFIX_PATH and CMAKE_INSTALL_PREFIX; the Python
# packages land in $VENV/lib/python3.X/site-packages (PYTHON_INSTALL_DIR, derived from
# Python3_EXECUTABLE by ament_cmake_python).
set -euo pipefail

usage() { echo "usage: $0 VENV [--install-only]" >&2; exit 2; }

[[ $# -ge 1 && $# -le 2 ]] || usage
install_only=0
if [[ $# -eq 2 ]]; then
  [[ $2 == --install-only ]] || usage
  install_only=1
fi

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=$(cd "$1" && pwd)   # absolute: cmake caches these paths
build=$repo/build/msgs

[[ -x $venv/bin/python ]] || { echo "$0: $venv/bin/python not found" >&2; exit 1; }

if [[ $install_only -eq 1 ]]; then
  [[ -f $build/cmake_install.cmake ]] || {
    echo "$0: $build is not built; run $0 $1 first" >&2; exit 1; }
  exec cmake --install "$build"
fi

export CMAKE_PREFIX_PATH=$venv
export AMENT_PREFIX_PATH=$venv

cmake -S "$repo" -B "$build" \
  -DCMAKE_INSTALL_PREFIX="$venv" \
  -DPython3_EXECUTABLE="$venv/bin/python" \
  -DBUILD_TESTING=OFF
cmake --build "$build" -j2
cmake --install "$build"
