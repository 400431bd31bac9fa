#!/usr/bin/env bash
# The test suite CI runs, in the active Python environment (installed by docker/install.sh): what `nox -s tests`
# runs in its virtual environment and what docker/Dockerfile.cpu runs in the image. One definition for both.
#
#   docker/test.sh            two lanes side by side: the unit and property tests (tests/) then two plugins' tests,
#                             beside the other three plugins' tests; then every test that mostly waits (three at a
#                             time); the other torchrun tests and the cells without a matrix place
#                             (integrations_tests/); the whole fault matrix (runs/matrix.{json,md,png}); the other
#                             guards. From the waiting tests on, only tests that mostly wait share the machine
#   docker/test.sh ARGS...    pytest over tests/ and integrations_tests/ only, with ARGS
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export OMP_NUM_THREADS=1
export SCOUT_SIGNATURE_CASES=2000  # the signature's property tests: 2,000 corruptions of each kind (10,000 alone)
STAGE1=(-m "not cells and not matrix and not guards" -q --durations=10)

if [ $# -gt 0 ]; then
  exec python -m pytest "${STAGE1[@]}" "$@"
fi

# Side by side: the unit tests use about a third of the 2 CI cores (most of their time is waiting on daemons,
# sockets and subprocesses) and each plugin's tests about half (one process importing its framework); together
# they take about 5.5 minutes instead of 8. Nothing here measures time against a threshold a neighbour could break:
# the multi-rank cells, whose hang thresholds and straggler timings do, run below, beside nothing but each other's
# kind of waiting cell.
LOGS=$(mktemp -d)
suite() {  # one pytest run, its output in $LOGS/<name>.log and its exit status in $LOGS/<name>.rc
  local name=$1
  shift
  local rc=0
  # Each its own temporary folder and no shared cache: two pytest processes at once write neither's files.
  python -m pytest -p no:cacheprovider --basetemp "$LOGS/tmp-$name" "$@" > "$LOGS/$name.log" 2>&1 || rc=$?
  echo "$rc" > "$LOGS/$name.rc"
}
plugins() {
  for plugin in "$@"; do suite "$plugin" -q --durations=10 "plugins/$plugin/tests"; done
}
# The plugins' tests run in processes of their own: their tests import the frameworks at module level.
(suite unit "${STAGE1[@]}" tests; plugins scout-hf scout-megatron) &
lane_a=$!
(plugins scout-torchtitan scout-deepspeed scout-lightning) &
lane_b=$!
wait "$lane_a" "$lane_b" || true
failed=0
for name in unit scout-hf scout-megatron scout-torchtitan scout-deepspeed scout-lightning; do
  echo "== $name"
  cat "$LOGS/$name.log" 2>/dev/null || true
  [ "$(cat "$LOGS/$name.rc" 2>/dev/null || echo missing)" = 0 ] || { echo "== $name FAILED"; failed=1; }
done
rm -rf "$LOGS"
# Every stage runs whatever an earlier one found: a red stage does not hide another stage's results.
status=$failed
stage() { "$@" || status=1; }

# From here on nothing runs beside a test that computes: a busy neighbour is what moves a straggler's timing or a
# replay's pace. Only tests that mostly wait (marked `waits`: hangs and stalls, 5-33 % of the machine each) run
# three at a time (pytest-xdist), beside each other: the torchrun and observer tests that wait, the plugins' hang
# cells, and every guard of a waiting cell. integrations_tests/conftest.py hands out the frameworks' cells last, so
# the core cells' ranks fork from workers without the frameworks.
stage python -m pytest -p no:cacheprovider -n 3 -m "waits and not cells and not matrix" -q --durations=10 integrations_tests
# Then one at a time: the other torchrun tests, and the cells without a matrix place (frameworks' cells last).
stage python -m pytest -m "not cells and not matrix and not guards and not waits" -q --durations=10 integrations_tests
# The matrix: the cells tagged `waits` three at a time side by side, then every other cell alone.
stage scout cells matrix --lanes 3 --out runs --workdir runs/cells
# The guards of cells that compute, one at a time. Core guards come first in the file, so their ranks fork from a
# parent without the frameworks.
stage python -m pytest -m "guards and not waits" -q --durations=10 integrations_tests/test_cells.py
exit "$status"
