#!/usr/bin/env bash
# The steps here around one device call of benchmarks/gpu_inference.py (the GPU benchmark of inference).
#
#   bash benchmarks/gpu_inference_trip.sh out GROUP   # before the call: GROUP 0..3 (gpu_inference.GROUPS)
#   bash benchmarks/gpu_inference_trip.sh back        # after it (also safe to run twice)
#
# out: the device tool sends the tracked tree and the carried paths, 64 MiB in all; the bundled weights
# (zoo/pretrained, 167 MB, tracked) leave the index for the trip (as zoo/tools/gpu/trip.sh does), the group's
# models go to .devrun/models/NAME (weights, config, tokenizer: no figures) and their datasets to .devrun/data.
# Device call: carry [".devrun"], timeout_s 600, command (group 0: speed, dynamic evaluation and equality):
#   ZOO_DATA_DIR=.devrun/data PYTHONPATH=. TQDM_DISABLE=1 python3 benchmarks/gpu_inference.py --group 0
#     --models-dir .devrun/models --out $OUT/gpu_inference.json
# then here: cp FILES_AT/gpu_inference.json benchmarks/results/ && .venv/bin/python -m zoo.tools.readme; later
# groups add their equality rows: --group N --parts equality --merge benchmarks/results/gpu_inference.json.
set -eu
cd "$(dirname "$0")/.."
exclude=$(git rev-parse --git-path info/exclude)   # (a worktree's .git is a file)
mkdir -p "$(dirname "$exclude")"
restore() {
  git reset -q -- zoo/pretrained
  sed -i '\#^/zoo/pretrained/$#d' "$exclude" 2>/dev/null || true
}
case ${1:-} in
  out)
    group=$2
    rm -rf .devrun/models .devrun/data && mkdir -p .devrun/models .devrun/data
    # (GROUPS read from the source: no torch needed here)
    names=$(python3 -c "import ast, sys; t = ast.parse(open('benchmarks/gpu_inference.py').read()); \
g = next(n.value for n in t.body if isinstance(n, ast.Assign) and getattr(n.targets[0], 'id', '') == 'GROUPS'); \
print(' '.join(ast.literal_eval(g)[int(sys.argv[1])]))" "$group")
    for name in $names; do
      mkdir -p ".devrun/models/$name"
      cp zoo/pretrained/"$name"/{config.json,model.safetensors,tokenizer.json,vocab.json} ".devrun/models/$name/" 2>/dev/null \
        || cp zoo/pretrained/"$name"/{config.json,model.safetensors,tokenizer.json} ".devrun/models/$name/"
      dataset=$(python3 -c "import json, sys; print(json.load(open(sys.argv[1]))['dataset'])" "zoo/pretrained/$name/config.json")
      [ -d ".devrun/data/$dataset" ] || cp -r "${ZOO_DATA_DIR:-../shared/data}/$dataset" .devrun/data/
    done
    [ "$group" != 0 ] || [ -d .devrun/data/ptb ] || cp -r "${ZOO_DATA_DIR:-../shared/data}/ptb" .devrun/data/  # (speed)
    grep -qx '/zoo/pretrained/' "$exclude" 2>/dev/null || echo /zoo/pretrained/ >> "$exclude"
    git rm -r -q --cached --ignore-unmatch zoo/pretrained
    echo "ready: group $group ($names): $(du -sh .devrun | cut -f1) to carry; after the call: bash $0 back"
    ;;
  back)
    restore
    git status --short | head -5
    ;;
  *) echo "usage: bash benchmarks/gpu_inference_trip.sh out GROUP | back" >&2; exit 2 ;;
esac
