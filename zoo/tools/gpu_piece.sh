#!/usr/bin/env bash
# One piece of a long GPU training run, on the device tool's machine (a lent GPU: at most ten minutes a command).
# The run dir lives on that machine only for the call: a piece carried out earlier (zoo/tools/ferry.py's parts in
# .devrun/ferry/, a carried path) is unpacked first, the recipe trains with CUDA graphs until the first epoch end
# past MINUTES (--pause-after-minutes: checkpointed, not finished), and the checkpoint goes back packed into $OUT
# with the run's log. Here, afterwards: python -m zoo.tools.ferry unpack FILES_AT runs/RECIPE
#
#   usage (device run, repo root, .devrun carried): bash zoo/tools/gpu_piece.sh RECIPE MINUTES
#
# Here, before and after the call(s): bash zoo/tools/gpu_trip.sh out RECIPE / back RECIPE FILES_AT (the bundled
# weights leave the index for the 64 MiB upload; the data and the packed run go to .devrun; back unpacks the piece).
# Two pieces in one session can share the machine while it is warm (30 s): the second finds /tmp/runs/RECIPE there
# and resumes it exactly (not the carried copy); guard its call with
# `test -f /tmp/runs/RECIPE/checkpoint/meta.json || exit 3` so that a fresh machine does not start from epoch 1.
set -u
recipe=$1 minutes=$2
export ZOO_DATA_DIR=${ZOO_DATA_DIR:-$PWD/.devrun/data} PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TQDM_DISABLE=1
run=/tmp/runs/$recipe
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c 'import torch; print("torch", torch.__version__)'
if [ -f "$run/checkpoint/meta.json" ]; then
  echo "resuming $run as this machine left it (a second piece on a warm machine)"
elif [ -f .devrun/ferry/ferry.json ]; then
  python3 -m zoo.tools.ferry unpack .devrun/ferry "$run" || exit 1
fi
# backstop, well inside the device tool's ten minutes a command (its kill would leave nothing to pack): a SIGTERM
# writes a checkpoint mid-epoch, which travels too (without best/)
backstop=$(python3 -c "import sys; print(min(540, int(float(sys.argv[1]) * 60) + 120))" "$minutes") || exit 1
timeout -s TERM "$backstop" python3 -m zoo.cli train "$recipe" --device cuda --cuda-graphs \
  --run-dir "$run" --resume --pause-after-minutes "$minutes" 2> "$OUT/train.err"
echo "zoo train exited $?"
tail -c 2500 "$OUT/train.err"
cp "$run/log.jsonl" "$OUT/log.jsonl"
python3 -m zoo.tools.ferry pack "$run" "$OUT" || exit 1
ls -la "$OUT"
