#!/usr/bin/env bash
# edgespec-profile on a GPU server as one prepared command (issue 36):
#   scripts/gpu_profile.sh OUT_DIR [edgespec-profile arguments...]
# Writes OUT_DIR/profile.json (a compute profile: --compute OUT_DIR/profile.json), measurements.json,
# report.txt, device.txt. Wheels in .whl/ (if any) are installed to /tmp/site first: a server with
# no network gets what it lacks that way (the project's dev machine downloads them). A smoke run on
# tiny shapes goes first, so a broken install fails in seconds, not minutes.
set -uo pipefail
out=${1:-out/gpu-profile}
shift || true
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | tee "$out/device.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())" | tee -a "$out/device.txt"
t0=$(date +%s)
[ -n "${SKIP_SMOKE:-}" ] || python3 -m edgespec_ros.bench.gpu_profile --shapes tiny,tiny --device cuda --quick --out /tmp/edgespec-smoke >/tmp/edgespec-smoke.log 2>&1 \
    || { tail -40 /tmp/edgespec-smoke.log; echo "smoke run failed"; exit 1; }
echo "smoke run ok in $(( $(date +%s) - t0 )) s"
python3 -m edgespec_ros.bench.gpu_profile --out "$out" "$@" 2>"$out/progress.log" | tee "$out/report.txt"
rc=${PIPESTATUS[0]}
[ "$rc" = 0 ] || tail -c 3000 "$out/progress.log" | tr '\r' '\n' | grep -v 'step/s]$' | tail -30
exit "$rc"
