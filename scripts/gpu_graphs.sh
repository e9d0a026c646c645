#!/usr/bin/env bash
# CUDA graphs of the verifier's passes on a GPU as one prepared command (docs/gpu-profile.md, "A pass
# near the floor"): scripts/gpu_graphs.sh OUT_DIR
# 1. the CUDA-only tests (capture, replay, fp32 greedy token identity alone and batched; tiny model);
# 2. the lazy-q byte count; 3. the 7B grid (random weights, bfloat16) with graphs off and on at 1, 8
# and 16 rows, blocks 1 (the AR step), 5 and 16; 4. the same grid in float32 at 1 and 8 rows (token
# identity, graphs on vs off). Budget: 8 minutes on one H200 (each step has its own timeout).
set -uo pipefail
out=${1:-out/gpu-graphs}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | tee "$out/device.txt"
rc=0
timeout 90 python3 -m pytest -q -p no:cacheprovider test/test_graphs.py test/test_lazy_q.py 2>&1 | tail -15 | tee "$out/tests.txt" || rc=1
timeout 60 python3 scripts/q_traffic.py | tee "$out/q_traffic.txt" || rc=1
timeout 200 python3 -m edgespec_ros.bench.graph_passes --shape qwen2-vl-7b --device cuda --dtype bfloat16 \
    --rows 1,8,16 --blocks 1,5,16 --kv-blocks 8,32 --passes 10 --json "$out/graphs-7b-bf16.json" 2>"$out/progress-bf16.log" \
    | tee "$out/graphs-7b-bf16.txt" || { rc=1; tail -30 "$out/progress-bf16.log"; }
timeout 150 python3 -m edgespec_ros.bench.graph_passes --shape qwen2-vl-7b --device cuda --dtype float32 \
    --rows 1,8 --blocks 1,5,16 --kv-blocks 8,32 --passes 3 --json "$out/graphs-7b-fp32.json" 2>"$out/progress-fp32.log" \
    | tee "$out/graphs-7b-fp32.txt" || { rc=1; tail -30 "$out/progress-fp32.log"; }
exit "$rc"
