#!/usr/bin/env bash
# ddpkit's CUDA/NCCL paths on a GPU machine that cannot download anything (issue 16; results in docs/gpu.md).
#
#   scripts/gpu_check.sh wheels [DIR]        here, with network: the wheels a CUDA torch image lacks (default .whl)
#   scripts/gpu_check.sh run [DIR] [OUT]     there, in the repo root: install ddpkit from this tree with
#                                            pip --no-deps and DIR's wheels, run every step, log to OUT (default
#                                            ./gpu-check), then the tests marked gpu
#
# The machine's own python3 (a CUDA build of torch, rich, numpy, pytest) is used as it is: ddpkit declares a
# torch range, so this also runs ddpkit on a torch other than the one CI pins.
set -uo pipefail

PY=${PYTHON:-python3}

wheels() {
    local dir=${1:-.whl}
    mkdir -p "$dir"
    # no wheel of python-hostlist was found here (pip download --only-binary): pip builds one (pure Python)
    "$PY" -m pip wheel -q --no-deps -w "$dir" python-hostlist==2.3.0
    ls -l "$dir"
}

# step NAME EXPECTED-EXIT COMMAND...: run it with a deadline, log its output and exit code, never stop the script
# (the log holds every step's output; OUT keeps it and the JSON reports, a few files)
step() {
    local name=$1 expected=$2
    shift 2
    echo "=== $name: \$ $*" | tee -a "$LOG"
    timeout 400 "$@" >"$work/$name.out" 2>&1
    local code=$?
    cat "$work/$name.out" >>"$LOG"
    local verdict=ok
    [ "$code" = "$expected" ] || verdict="UNEXPECTED (wanted $expected)"
    echo "=== $name: exit $code $verdict" | tee -a "$LOG"
    tail -n 25 "$work/$name.out"
}

run() {
    local dir=${1:-.whl}
    OUTDIR=${2:-gpu-check}
    mkdir -p "$OUTDIR"
    LOG=$OUTDIR/gpu_check.log
    : >"$LOG"
    local site=/tmp/ddpkit-site build=/tmp/ddpkit-wheel
    rm -rf "$site" "$build"
    work=$(mktemp -d)
    "$PY" -m pip wheel -q --no-deps --no-build-isolation --no-index -w "$build" . || exit 1
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$build"/ddpkit-*.whl \
        "$dir"/python_hostlist-*.whl || exit 1
    export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH} PATH=$site/bin:$PATH PYTHONUNBUFFERED=1
    mkdir -p "$work"/{base,cut,async,shared}
    {
        nvidia-smi -L
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
        "$PY" -c 'import torch, torch.distributed as d; print("torch", torch.__version__, "cuda", torch.version.cuda,
"nccl", ".".join(map(str, torch.cuda.nccl.version())), "gpus", torch.cuda.device_count(),
"uuid", torch.cuda.get_device_properties(0).uuid, "gloo", d.is_gloo_available(), "nccl", d.is_nccl_available())'
        "$PY" -c 'import ddpkit, hostlist, rich; print("ddpkit", ddpkit.__version__, "from", ddpkit.__file__)'
    } 2>&1 | tee -a "$LOG"
    step env-connect 0 ddpkit env --connect
    step check-1 0 ddpkit check -n 1 --json "$OUTDIR/check-1.json"
    step bench-1 0 ddpkit bench -n 1 -b 8 -e 256M -f 4 --json "$OUTDIR/bench-1.json"
    local job=(--model mlp --samples 4096 --epochs 4 --seed 3 --deterministic --keep 4)
    step train-base 0 ddpkit train "${job[@]}" --snapshot-path "$work/base/snap.pt" --json "$OUTDIR/train-base.json"
    step train-preempt 75 ddpkit train "${job[@]}" --snapshot-path "$work/cut/snap.pt" --drill preempt@epoch=2 \
        --json "$work/cut.json"
    step train-resume 0 ddpkit train "${job[@]}" --snapshot-path "$work/cut/snap.pt" --drill preempt@epoch=2 \
        --json "$OUTDIR/train-resume.json"
    step train-async 0 ddpkit train "${job[@]}" --snapshot-path "$work/async/snap.pt" --async-snapshot \
        --json "$OUTDIR/train-async.json"
    step compare 0 "$PY" - "$work" "$OUTDIR" <<'PYEOF'
import json, statistics, sys
from pathlib import Path
from tests.helpers import newest_snapshot, same_state

work, out = Path(sys.argv[1]), Path(sys.argv[2])
base, cut, asyn = (newest_snapshot(work / name)[1] for name in ("base", "cut", "async"))
devices = sorted({str(t.device) for t in base["model"].values()})
print("snapshot tensors on", devices, "| cuda RNG saved:", "cuda" in base["rng"][0])
for name, state in (("preempted+resumed", cut), ("async", asyn)):
    same = {k: same_state(state, base, (k,)) for k in ("model", "optimizer", "rng", "loss_history")}
    print(f"{name} vs uninterrupted, bitwise: {same}")
    assert all(same.values()), name
for name in ("train-base", "train-async"):
    s = json.loads((out / f"{name}.json").read_text())
    stalls = [round(x * 1e3, 2) for x in s["snapshot_stall_s"]]
    print(f"{name}: {s['parameters']} parameters on {s['device']} ({s['backend']}), snapshot stall ms {stalls}, "
          f"median {statistics.median(stalls):.2f} ms, final loss {s['final_loss']:.6f}")
PYEOF
    step shared-check 2 ddpkit check -n 2
    step shared-train 2 ddpkit train -n 2 --model mlp --snapshot-path "$work/shared/snap.pt"
    step shared-bench 2 ddpkit bench -n 2
    step shared-gloo 0 ddpkit train -n 2 --backend gloo --samples 512 --epochs 2
    step shared-gloo-check 0 ddpkit check -n 2 --backend gloo
    step gloo-cuda 0 "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 tests/workers/gloo_cuda_tensors.py
    # the watch (issue 27) on NCCL: its added time per step on a CUDA step, watched and unwatched steps alternating
    for model in ours hookless; do
        step "watch-pairs-$model" 0 "$PY" benchmarks/watch_step_pairs.py --device cuda --model "$model" \
            --pairs 5000 --json "$OUTDIR/watch-pairs-$model.json"
    done
    step pytest-gpu 0 "$PY" -m pytest -v -p no:cacheprovider -m gpu tests/gpu
    grep "^=== .*: exit" "$LOG"
    rm -rf "$work"
    ! grep -q "UNEXPECTED" "$LOG"
}

case ${1:-} in
    wheels) shift; wheels "$@" ;;
    run) shift; run "$@" ;;
    *) sed -n 2,10p "$0"; exit 2 ;;
esac
