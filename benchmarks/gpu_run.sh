#!/usr/bin/env bash
# The GPU run (benchmarks/gpu_run.py): every CUDA path of OffloadAdamW checked and measured, under 8 minutes.
#
#   bash benchmarks/gpu_run.sh OUTDIR                  # on the GPU machine, with its own python3
#   bash benchmarks/gpu_run.sh OUTDIR --cpu-rehearsal  # without CUDA: the sections that need none, small sizes
#
# Uses the machine's python3 as it is (PYTHON=... to choose another) with this checkout's sources first
# on the path: no virtual environment, no package installs (the GPU machine has no network). Writes
# OUTDIR/gpu_run.json, OUTDIR/gpu_run.log (this output), OUTDIR/logs/, OUTDIR/traces/ and the PNGs
# (when matplotlib is installed). Extra arguments go to gpu_run.py (--only SECTIONS, --budget-s S, --quick).
set -u
if [ $# -lt 1 ] || [ "${1#-}" != "$1" ]; then
    echo "usage: bash benchmarks/gpu_run.sh OUTDIR [--cpu-rehearsal] [--quick] [--only SECTIONS] [--budget-s S]" >&2
    exit 2
fi
OUTDIR=$1
shift
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(dirname "$HERE")
PYTHON=${PYTHON:-python3}
mkdir -p "$OUTDIR"
cd "$ROOT" || exit 2
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
LOG="$OUTDIR/gpu_run.log"
{
    echo "gpu_run.sh: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname), $("$PYTHON" --version 2>&1)"
    # The driver keeps to its own budget (430 s, the last row killed by 445 s); this outer limit only
    # catches a driver that hangs. With the plots that is 8 minutes at the very most.
    timeout --signal=TERM --kill-after=5 450 "$PYTHON" benchmarks/gpu_run.py "$OUTDIR" "$@"
    status=$?
    if [ -f "$OUTDIR/gpu_run.json" ]; then
        timeout 25 "$PYTHON" benchmarks/gpu_run.py --plot "$OUTDIR/gpu_run.json"
    fi
    echo "gpu_run.sh: exit status $status"
    exit $status
} 2>&1 | tee "$LOG"
exit "${PIPESTATUS[0]}"
