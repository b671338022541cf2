#!/usr/bin/env bash
# The whole test suite, as `make test` and CI run it, in two passes:
#  1. every test not marked `serial`, on $TEST_WORKERS pytest-xdist workers (default 3). Whole modules go to
#     one worker (--dist loadscope), so a module's shared engine or server still starts once. The longest
#     modules are handed out first, in the order tests/conftest.py puts them (tests/support/module_order.py:
#     from tests/module_seconds.json; --no-loadscope-reorder keeps it; xdist would otherwise send the
#     modules with the most tests first, the unit tests, and leave the engine modules to the end, one
#     worker finishing a long one while the others idle). TIERCACHE_RECORD_MODULE_SECONDS=1 rewrites the
#     file from the run. Three workers on two cores, because much of a test's time is waiting (a server's
#     health polls, its requests, Redis failovers), not computing; a fourth made a whole run slower (19:04
#     against 18:19 on a 2-core VM). Three only since OpenMP waits passively in the suite
#     (tests/conftest.py): with vLLM's default spinning, engines on shared cores slowed each other down.
#  2. the tests marked `serial`, alone: their assertions depend on time (a read timeout against a hung
#     or failing-over server, a lookup budget), which a second engine beside them would stretch.
# Both passes always run; the script fails if either failed or collected nothing.
set -u
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
WORKERS=${TEST_WORKERS:-3}
ARGS=(-q -p no:cacheprovider --durations=15 "$@")

echo "tiercache test: pass 1 of 2, tests not marked serial, on $WORKERS workers"
"$PY" -m pytest "${ARGS[@]}" -n "$WORKERS" --dist loadscope --no-loadscope-reorder -m "not serial" tests
first=$?
echo "tiercache test: pass 2 of 2, tests marked serial, one at a time"
"$PY" -m pytest "${ARGS[@]}" -m serial tests
second=$?
if [ "$first" -ne 0 ] || [ "$second" -ne 0 ]; then
  echo "tiercache test: FAILED (pass 1 exit $first, pass 2 exit $second; 5 means no test was collected)"
  exit 1
fi
