#!/usr/bin/env bash
# The GPU run (`make gpu-check OUT=DIR`): the selftest with --bench, then the gpu-marked tests; within 9 minutes,
# at most 4 files in OUTDIR, what answers the most first.
#
#   bash benchmarks/gpu_check.sh OUTDIR
#
# Uses the machine's python3 as it is (PYTHON=... to choose another) with this checkout's sources first on the
# path: no virtual environment, no installs (the GPU machine has no network). Writes into OUTDIR:
#   selftest.json   the environment, the parity table, the bench (offload-adamw selftest --json)
#   selftest.txt    what the selftest printed (stdout and stderr)
#   gpu-tests.txt   pytest -m gpu's output (FSDP2 over NCCL, placements, checkpoints, wrappers on CUDA)
#   gpu-check.txt   one line per part with its exit status and seconds
# Time: the selftest's parity table (about a minute on a GPU), then its --bench rows within --budget-s 210 (a row
# already started finishes: the outer limit is 330 s), then the gpu tests within 180 s: 510 s at the very most.
# Exit status: the selftest's (0 exact, 1 a row differs) unless it is 0 and the gpu tests failed (then theirs).
set -u
if [ $# -ne 1 ] || [ "${1#-}" != "$1" ]; then
    echo "usage: bash benchmarks/gpu_check.sh OUTDIR" >&2
    exit 2
fi
OUTDIR=$1
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(dirname "$HERE")
PYTHON=${PYTHON:-python3}
mkdir -p "$OUTDIR" || exit 2
OUTDIR=$(cd "$OUTDIR" && pwd)
cd "$ROOT" || exit 2
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1  # into a pipe: what a part printed before a time limit stopped it is kept
SUMMARY="$OUTDIR/gpu-check.txt"
echo "gpu-check: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname), $("$PYTHON" --version 2>&1)" | tee "$SUMMARY"

start=$SECONDS
timeout --signal=INT --kill-after=10 330 "$PYTHON" -m offload_adamw selftest --bench --budget-s 210 --no-progress \
    --json "$OUTDIR/selftest.json" 2>&1 | tee "$OUTDIR/selftest.txt"
selftest=${PIPESTATUS[0]}
echo "selftest --bench: exit status $selftest, $((SECONDS - start)) s" | tee -a "$SUMMARY"

start=$SECONDS
timeout --signal=INT --kill-after=10 180 "$PYTHON" -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 \
    | tee "$OUTDIR/gpu-tests.txt"
tests=${PIPESTATUS[0]}
echo "pytest -m gpu: exit status $tests, $((SECONDS - start)) s" | tee -a "$SUMMARY"

if [ "$selftest" -ne 0 ]; then
    exit "$selftest"
fi
exit "$tests"
