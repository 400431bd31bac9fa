#!/usr/bin/env bash
# The test suite CI runs, in the active Python environment (installed by docker/install.sh): what `nox -s tests`
# runs in its virtual environment and what docker/Dockerfile.cpu runs in the image. One definition for both.
#
#   docker/test.sh            unit and property tests, the torchrun tests, the cells without a matrix place; then
#                             the whole fault matrix (runs/matrix.{json,md,png}); then the guards but the heavy
#                             ones; then the plugins' tests
#   docker/test.sh ARGS...    the first pytest run only, with ARGS
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export OMP_NUM_THREADS=1
export SCOUT_SIGNATURE_CASES=2000  # the signature's property tests: 2,000 corruptions of each kind (10,000 alone)

python -m pytest -m "not cells and not matrix and not guards" -q --durations=10 "$@"
[ $# -eq 0 ] || exit 0
scout cells matrix --out runs --workdir runs/cells
# The guards (each cell re-run with one mechanism removed must turn red), but the heavy ones (13 to 45 s each, for
# which CI has no room: integrations_tests/conftest.py HEAVY_GUARDS, run by `nox -s guards`). Core guards come first in the file, so
# their ranks fork from a parent without the frameworks.
python -m pytest -m "guards and not heavy" -q --durations=10 integrations_tests/test_cells.py
# The plugins' tests in processes of their own (their tests import the frameworks at module level). The first
# pytest run above imports them into its parent too, once its plugin cells have run: the core cells before them
# fork from a parent without them; the matrix runs the core cells first for the same reason.
for plugin in scout-torchtitan scout-megatron scout-deepspeed scout-hf scout-lightning; do
  python -m pytest -q --durations=10 "plugins/$plugin/tests"
done
