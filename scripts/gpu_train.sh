#!/usr/bin/env bash
# Target training pilots on a GPU server as prepared commands (issue 37): the data stage, then
# several targets trained side by side on one GPU (each its own process, seed and shape, the same
# wall-clock budget), then the card's target figures for each on every core (edgespec-train compare).
#   scripts/gpu_train.sh train OUT_DIR    # data + the targets; each target as OUT_DIR/<name>.tar
#   scripts/gpu_train.sh eval OUT_DIR     # the figures: OUT_DIR/compare.json, compare.txt
# Variables: BUDGET (s of training per target, default 360), BATCH (128), VARIANTS ("name:seed:spec ...",
# spec as --target-spec, DEVICE (cuda), EVAL_ARGS (e.g. --compare-episodes 8 for a smoke run), "-" for the committed shape), SCENARIOS (1500), WORK (build/gpu-train: kept
# between the two commands on a warm machine). The tower the targets start from: build/train/vision
# (`edgespec-train vision`), carried. Wheels in .whl/ are installed to /tmp/site first.
set -uo pipefail
phase=${1:?train or eval}
out=${2:-out/gpu-train}
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null && [ ! -d /tmp/site/transformers ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
work=${WORK:-build/gpu-train}
variants=${VARIANTS:-"base-s0:0:- base-s1:1:- deep8-s0:0:layers=8 deep8-s1:1:layers=8"}
train() {
    mkdir -p "$work/tokenizer"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | tee "$out/device.txt"
    python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available(), 'cpus', __import__('os').cpu_count())" | tee -a "$out/device.txt"
    # the committed tokenizer: the new targets stay compatible with the committed draft
    cp edgespec_ros/models/target/tokenizer*.json edgespec_ros/models/target/chat_template.jinja "$work/tokenizer/"
    [ -d build/train/vision ] && cp -r build/train/vision "$work/" || { echo "build/train/vision missing: carry it"; exit 1; }
    t0=$(date +%s)
    mkdir -p "$work/logs"
    python3 -m edgespec_ros.train.cli data --work "$work" --train-scenarios "${SCENARIOS:-1500}" 2>"$work/logs/data.log" | tail -1 || exit 1
    echo "data: $(( $(date +%s) - t0 )) s"
    pids=()
    for v in $variants; do
        IFS=: read -r name seed spec <<<"$v"
        [ "$spec" = "-" ] && spec=""
        OMP_NUM_THREADS=1 python3 -m edgespec_ros.train.cli target --work "$work" --out "$work/$name" --device "${DEVICE:-cuda}" \
            --seed "$seed" --target-spec "$spec" --batch-size "${BATCH:-128}" --target-budget-s "${BUDGET:-360}" \
            --target-steps 200000 --loader-workers 3 --checkpoint-every-s 120 >"$work/logs/$name.log" 2>&1 &
        pids+=($!)
    done
    rc=0
    for p in "${pids[@]}"; do wait "$p" || rc=1; done
    echo "training: $(( $(date +%s) - t0 )) s, rc $rc"
    for v in $variants; do
        name=${v%%:*}
        tr '\r' '\n' <"$work/logs/$name.log" | grep -v '/s[],]' | tail -4 | tee -a "$out/train.log"
        [ -f "$work/$name/target/config.json" ] && tar -cf "$out/$name.tar" -C "$work/$name" target
    done
    return $rc
}
evaluate() {
    dirs=""
    for v in $variants; do dirs="$dirs${dirs:+,}$work/${v%%:*}/target"; done
    python3 -m edgespec_ros.train.cli compare --targets "$dirs" --workers "$(nproc)" ${EVAL_ARGS:-} --json "$out/compare.json" \
        2>"$work/logs/eval.log" | tee "$out/compare.txt"
    rc=${PIPESTATUS[0]}
    [ "$rc" = 0 ] || tr '\r' '\n' <"$work/logs/eval.log" | grep -v '/s\]$' | tail -30
    return "$rc"
}
case $phase in
    train) train ;;
    eval) evaluate ;;
    *) echo "phase: train or eval"; exit 2 ;;
esac
