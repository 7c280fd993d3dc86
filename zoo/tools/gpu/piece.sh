#!/usr/bin/env bash
# On the device tool's lent machine (repo root, .devrun carried): zoo/tools/gpu/piece.py with the trip's data and
# environment. It trains several recipes at once, stops each with SIGTERM before the budget, packs them and returns
# what fits into $OUT (see that module; the session's order and commands: model_cards/runs/QUEUE.md).
#
#   bash zoo/tools/gpu/piece.sh train alstm-ptb-17m-ref lstm-ptb-17m-ref --budget-s 500
#   bash zoo/tools/gpu/piece.sh collect lstm-ptb-17m-ref       # a pack left on the warm machine, next call
set -u
export ZOO_DATA_DIR=${ZOO_DATA_DIR:-$PWD/.devrun/data} PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TQDM_DISABLE=1
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader || true
python3 -c 'import torch; print("torch", torch.__version__)'
exec python3 -m zoo.tools.gpu.piece "$@"
