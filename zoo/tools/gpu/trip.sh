#!/usr/bin/env bash
# The steps here around a GPU piece (zoo/tools/gpu/piece.sh runs it on the lent machine); the order and commands
# of a whole session are in model_cards/runs/QUEUE.md.
#
#   bash zoo/tools/gpu/trip.sh out NAME [NAME...]   # before a device call: data and packs of the NAMEs
#   CARRY="NAME" bash zoo/tools/gpu/trip.sh out ...  # the data of every NAME, the pack of the CARRY ones only
#   bash zoo/tools/gpu/trip.sh out                   # (no NAME) nothing to carry: a `collect` call
#   bash zoo/tools/gpu/trip.sh back NAME FILES_AT   # after: FILES_AT/NAME is the returned pack; it is unpacked
#                                                   # into runs/NAME and committed in model_cards/runs/NAME/
#
# out: the device tool sends the tracked tree and the carried paths, 64 MiB in all; the bundled weights
# (zoo/pretrained, ~160 MB) and the committed packs (model_cards/runs/*/, up to 52 MB each) are not needed there,
# so they leave the index for the trip (ignored meanwhile). Each run's latest state goes to .devrun/ferry/NAME:
# runs/NAME packed, or, when runs/NAME is missing (a fresh clone), its committed pack (zoo/tools/gpu/runpack.py).
# The recipes' datasets go to .devrun/data. back: the index and .git/info/exclude as they were, then the pack.
# Both are safe to run twice. Device call: carry [".devrun"], command `bash zoo/tools/gpu/piece.sh train NAME...`.
set -eu
cd "$(dirname "$0")/../.."
what=$1
shift
py=${PYTHON:-.venv/bin/python}
packs() { git ls-files 'model_cards/runs/*/ferry.json' | xargs -r -n1 dirname; }
restore() {
  git reset -q -- zoo/pretrained model_cards/runs
  sed -i '\#^/zoo/pretrained/$#d; \#^/model_cards/runs/\*/$#d' .git/info/exclude
}
case $what in
  out)
    rm -rf .devrun/data .devrun/ferry && mkdir -p .devrun/data .devrun/ferry
    for name in "$@"; do
      dataset=$($py -c "import sys; from zoo.training import Recipe, recipe_path; print(Recipe.load(recipe_path(sys.argv[1])).dataset)" "$name")
      [ -d ".devrun/data/$dataset" ] || cp -r "${ZOO_DATA_DIR:-../shared/data}/$dataset" .devrun/data/  # (a dataset's name is its folder)
    done
    carry=${CARRY-$*}  # whose packs go (default: every NAME; CARRY="" none): one 17M pack fills a call
    [ -z "$carry" ] || $py -m zoo.tools.gpu.runpack carry $carry --to .devrun/ferry
    for line in /zoo/pretrained/ '/model_cards/runs/*/'; do grep -qxF "$line" .git/info/exclude || echo "$line" >> .git/info/exclude; done
    for d in zoo/pretrained $(packs); do git rm -r -q --cached --ignore-unmatch "$d"; done
    echo "ready: $(du -sh .devrun | cut -f1) to carry; after the call: bash zoo/tools/gpu/trip.sh back NAME FILES_AT"
    ;;
  back)
    name=$1 files=$2
    restore
    parts=$files/$name
    [ -f "$parts/ferry.json" ] || parts=$files  # (a pack returned flat)
    $py -m zoo.tools.gpu.ferry unpack "$parts" "runs/$name" || echo "(runs/$name not replaced: see above)"
    $py -m zoo.tools.gpu.runpack commit "$name" "$parts"
    git status --short | head -5
    ;;
  restore) restore ;;
  *) echo "usage: bash zoo/tools/gpu/trip.sh out NAME... | back NAME FILES_AT | restore" >&2; exit 2 ;;
esac
