#!/usr/bin/env bash
# The steps here around a piece of a long GPU run (zoo/tools/gpu_piece.sh runs the piece on the lent machine).
#
#   bash zoo/tools/gpu_trip.sh out RECIPE            # before the device call(s)
#   bash zoo/tools/gpu_trip.sh back RECIPE FILES_AT  # after: FILES_AT is the last call's files folder
#
# out: the device tool sends the tracked tree and the carried paths, 64 MiB in all, and the bundled weights
# (zoo/pretrained, ~160 MB, tracked) are not needed there, so they leave the index for the trip (ignored meanwhile);
# the recipe's dataset goes to .devrun/data and the run so far, packed (zoo/tools/ferry.py), to .devrun/ferry.
# back: the index and .git/info/exclude as they were, the returned piece unpacked into runs/RECIPE.
# Both are safe to run twice. Device call: carry [".devrun"], command `bash zoo/tools/gpu_piece.sh RECIPE MINUTES`.
set -eu
cd "$(dirname "$0")/../.."
what=$1 recipe=$2
py=.venv/bin/python
restore() {
  git reset -q -- zoo/pretrained
  sed -i '\#^/zoo/pretrained/$#d' .git/info/exclude
}
case $what in
  out)
    dataset=$($py -c "import sys; from zoo.train import Recipe, recipe_path; print(Recipe.load(recipe_path(sys.argv[1])).dataset)" "$recipe")
    rm -rf .devrun/data .devrun/ferry && mkdir -p .devrun/data
    cp -r "${ZOO_DATA_DIR:-../shared/data}/$dataset" .devrun/data/  # (a dataset's name is its folder)
    if [ -f "runs/$recipe/checkpoint/meta.json" ]; then $py -m zoo.tools.ferry pack "runs/$recipe" .devrun/ferry; fi
    grep -qx '/zoo/pretrained/' .git/info/exclude || echo /zoo/pretrained/ >> .git/info/exclude
    git rm -r -q --cached --ignore-unmatch zoo/pretrained
    echo "ready: $(du -sh .devrun | cut -f1) to carry; after the call: bash zoo/tools/gpu_trip.sh back $recipe FILES_AT"
    ;;
  back)
    restore
    $py -m zoo.tools.ferry unpack "$3" "runs/$recipe"
    rm -rf .devrun/ferry
    git status --short | head -5
    ;;
  *) echo "usage: bash zoo/tools/gpu_trip.sh out|back RECIPE [FILES_AT]" >&2; exit 2 ;;
esac
