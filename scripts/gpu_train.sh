#!/usr/bin/env bash
# Target training pilots on a GPU server as prepared commands (issue 37): the data stage, then
# several targets trained side by side on one GPU (each its own process, seed and shape, the same
# wall-clock budget), then the card's target figures for each on every core (edgespec-train compare).
#   scripts/gpu_train.sh train OUT_DIR    # data + the targets; each target as OUT_DIR/<name>.tar
#   scripts/gpu_train.sh eval OUT_DIR     # the figures: OUT_DIR/compare.json, compare.txt
# Variables: BUDGET (s of training per target, default 360), BATCH (128), VARIANTS ("name:seed:spec[:data[:opts]] ...",
# spec as --target-spec, "-" for the committed shape; data: the data stage's options, e.g.
# "memory=2,memory-noise=0.15" for a policy with memory, "expert=stop_gap_m=0.3" for another expert (several
# settings: "expert=stop_gap_m=0.3;approach_turn=medium"), "-" or absent for the committed data; opts: more
# target-stage options, e.g. "target-init=edgespec_ros/models/target,target-lr=0.001" to continue the
# committed target's training), DEVICE (cuda),
# EVAL_ARGS (e.g. --compare-episodes 8 for a smoke run), SCENARIOS (1500), WORK (build/gpu-train: kept
# between the two commands on a warm machine). The tower the targets start from: build/train/vision
# (`edgespec-train vision`), carried. Wheels in .whl/ are installed to /tmp/site first.
# Carrying a run across GPU machines (docs/models.md: "Carrying a run across GPU machines"): each target
# also checkpoints (every 120 s, when paused and at its end) into OUT_DIR/<name>/target in pieces of at
# most PIECE_MIB MiB (15; what comes back from a device machine: at most 8 files of 16 MiB) with
# checkpoint.pt.manifest.json (edgespec_ros.train.pieces); PIECE_S (s) pauses each target after that
# much training in this call (exit status 3), STEPS (200000) caps its steps (with BUDGET=0 the run is
# fixed in steps: the same on any machine). Copy what came back of OUT_DIR/<name> to CARRY/<name>
# (CARRY: build/gpu-carry), carry CARRY to the next machine, and the same command there verifies and
# joins those pieces and resumes each such target (--resume); a missing or damaged piece stops it before
# anything runs. A finished target's pieces are removed from OUT_DIR (its <name>.tar holds the model).
set -uo pipefail
phase=${1:?train or eval}
out=${2:-out/gpu-train}
mkdir -p "$out"
if [ -z "${SKIP_WHEELS:-}" ] && compgen -G ".whl/*.whl" >/dev/null && [ ! -d /tmp/site/transformers ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
work=${WORK:-build/gpu-train}
variants=${VARIANTS:-"base-s0:0:- base-s1:1:- deep8-s0:0:layers=8 deep8-s1:1:layers=8"}
carry=${CARRY:-build/gpu-carry}
data_args() {  # "memory=2,memory-noise=0.15" -> --memory 2 --memory-noise 0.15
    [ -z "$1" ] || [ "$1" = "-" ] && return
    local item
    IFS=, read -ra items <<<"$1"
    for item in "${items[@]}"; do printf -- '--%s %s ' "${item%%=*}" "${item#*=}"; done
}
data_dir() { [ -z "$1" ] || [ "$1" = "-" ] && echo "$work/data" || echo "$work/data-${1//[^a-z0-9.]/_}"; }
train() {
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | tee "$out/device.txt"
    python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available(), 'cpus', __import__('os').cpu_count())" | tee -a "$out/device.txt"
    [ -d build/train/vision ] || { echo "build/train/vision missing: carry it"; exit 1; }
    # pieces carried from an earlier machine: verified before anything runs, then where this call's go
    for v in $variants; do
        name=${v%%:*}
        [ -d "$carry/$name" ] || continue
        python3 -m edgespec_ros.train.pieces verify "$carry/$name/target/checkpoint.pt.manifest.json" \
            --copy-to "$out/$name/target" || exit 1
    done
    t0=$(date +%s)
    mkdir -p "$work/logs"
    # one data stage per distinct data option set, every core each (sim.dataset is per-scenario deterministic)
    for data in $(for v in $variants; do IFS=: read -r _ _ _ d _ <<<"$v"; echo "${d:--}"; done | sort -u); do
        dir=$(data_dir "$data")
        mkdir -p "$dir/tokenizer"
        # the committed tokenizer: the new targets stay comparable with (and loadable beside) the committed models
        cp edgespec_ros/models/target/tokenizer*.json edgespec_ros/models/target/chat_template.jinja "$dir/tokenizer/"
        cp -r build/train/vision "$dir/"
        # shellcheck disable=SC2046
        python3 -m edgespec_ros.train.cli data --work "$dir" --train-scenarios "${SCENARIOS:-1500}" $(data_args "$data") \
            2>"$work/logs/data.log" | tail -1 || exit 1
    done
    echo "data: $(( $(date +%s) - t0 )) s"
    pids=()
    for v in $variants; do
        IFS=: read -r name seed spec data opts <<<"$v"
        [ "$spec" = "-" ] && spec=""
        resume=""
        [ -f "$out/$name/target/checkpoint.pt.manifest.json" ] && resume=--resume
        # shellcheck disable=SC2046,SC2086
        OMP_NUM_THREADS=1 python3 -m edgespec_ros.train.cli target --work "$(data_dir "${data:--}")" --out "$work/$name" \
            --device "${DEVICE:-cuda}" $(data_args "${data:--}") $(data_args "${opts:--}") \
            --seed "$seed" --target-spec "$spec" --batch-size "${BATCH:-128}" --target-budget-s "${BUDGET:-360}" \
            --target-steps "${STEPS:-200000}" --loader-workers 3 --checkpoint-every-s 120 \
            --checkpoint-pieces "$out/$name" --checkpoint-piece-mib "${PIECE_MIB:-15}" \
            --pause-after-s "${PIECE_S:-0}" $resume >"$work/logs/$name.log" 2>&1 &
        pids+=($!)
    done
    rc=0
    status=()
    for p in "${pids[@]}"; do wait "$p"; s=$?; status+=("$s"); [ "$s" = 0 ] || [ "$s" = 3 ] || rc=1; done
    echo "training: $(( $(date +%s) - t0 )) s, rc $rc"
    i=0
    for v in $variants; do
        name=${v%%:*}
        s=${status[$i]}
        i=$((i + 1))
        if [ "$s" = 0 ]; then
            rm -rf "${out:?}/$name"  # finished: the model travels in $name.tar
        elif [ -f "$out/$name/target/checkpoint.pt.manifest.json" ]; then
            echo "$name: $([ "$s" = 3 ] && echo paused || echo "failed (exit $s)"), its last checkpoint in pieces in" \
                "$out/$name/target: copy it to $carry/$name to carry the run on" | tee -a "$out/train.log"
        fi
        tr '\r' '\n' <"$work/logs/$name.log" | grep -v '/s[],]' | tail -4 | tee -a "$out/train.log"
        [ -f "$work/$name/target/training.json" ] && python3 -c "import json,sys; t=json.load(open(sys.argv[1])); print(sys.argv[2], t['steps'], 'steps,', t['examples_per_s'], 'examples/s, loss', round(t['final_loss'], 3))" "$work/$name/target/training.json" "$name" | tee -a "$out/train.log"
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
