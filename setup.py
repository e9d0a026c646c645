"""pip install . -> the ROS-free core and the cloud verifier (no ROS needed).

On a robot, `colcon build` uses CMakeLists.txt instead (messages + nodes + launch files).
The dev/CI venv pins exact versions in requirements/dev.txt (torch==2.13.0 CPU there); the
ranges below are for real deployments (a GPU server picks its own CUDA torch).
"""
from setuptools import find_packages, setup

setup(
    name="edgespec_ros",
    version="0.1.0",
    description="Edge-cloud speculative decoding of VLM control for legged robots",
    packages=find_packages(include=["edgespec_ros", "edgespec_ros.*"]),
    package_data={"edgespec_ros": ["models/**/*", "sim/scenarios/*.json", "bench/shapes/*.json"]},
    include_package_data=True,
    python_requires=">=3.10",
    # Lower bounds: the oldest releases the ROS-free tests pass with (run with transformers 5.4.0,
    # websockets 16.0, numpy 1.26.4, scipy 1.11.4, pillow 10.0.0, safetensors 0.4.3, tqdm 4.66.1,
    # tokenizers 0.22.2 and torch 2.13.0); requirements/robot.txt says the same for the robot.
    install_requires=[
        "torch>=2.2",
        "transformers>=5.4,<6",  # the 5.x Qwen2-VL API (mm_token_type_ids), the PIL image processor
        "tokenizers>=0.22",
        "websockets>=16",  # 13-15 lose the close reason on shutdown (test_cloud_hardening)
        "numpy>=1.26",  # 1.x too: ROS Humble's and Jazzy's own C extensions are built against it
        "scipy>=1.11",
        "safetensors>=0.4.3",
        "pillow>=10.0",
        "tqdm>=4.66",
        "rosbags>=0.11.9",  # recordings: demo/sim bags, edgespec-bench --replay (MCAP and sqlite3, no ROS needed)
        "prometheus-client>=0.26",  # the verifier's /metrics
    ],
    extras_require={
        "robot": ["opencv-python-headless>=4.8", "matplotlib>=3.7", "qwen-vl-utils>=0.0.14"],
        # int8 / nf4 weights (--quantization, the drafter's quantization parameter); CUDA only
        "quant": ["bitsandbytes>=0.45"],
        "test": ["pytest", "pytest-timeout", "hypothesis"],
        # edgespec-verifier --replicas N: the verifier scaled out on Ray Serve
        "fleet": ["ray[serve]>=2.60,<3"],
    },
    entry_points={
        "console_scripts": [
            "edgespec-verifier = edgespec_ros.cloud.cli:main",
            "edgespec-bench = edgespec_ros.bench.cli:main",
            "edgespec-profile = edgespec_ros.bench.gpu_profile:main",
            "edgespec-demo = edgespec_ros.bringup.demo:main",
            "edgespec-sim = edgespec_ros.evaluation.cli:main",
            "edgespec-train = edgespec_ros.train.cli:main",
            "edgespec-bringup = edgespec_ros.bringup.closed_loop:main",
            # the ROS 2 nodes (colcon installs the same entry points as lib/edgespec_ros/<node>)
            "edgespec-camera = edgespec_ros.nodes.camera:main",
            "edgespec-drafter = edgespec_ros.nodes.drafter:main",
            "edgespec-navigator = edgespec_ros.nodes.navigator:main",
            "edgespec-monitor = edgespec_ros.nodes.monitor:main",
            "edgespec-sim-robot = edgespec_ros.nodes.sim_robot:main",
        ],
    },
)
