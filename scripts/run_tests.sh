#!/usr/bin/env bash
# The whole test suite, as `make test` and CI run it, in two passes that run side by side:
#  1. every test not marked `serial`, on $TEST_WORKERS pytest-xdist workers (default 3), at a lower CPU
#     priority (nice $PASS1_NICE, default 10). Whole modules go to one worker (--dist loadscope), so a
#     module's shared engine or server still starts once. The longest modules are handed out first, in the
#     order tests/conftest.py puts them (tests/support/module_order.py: from tests/module_seconds.json;
#     --no-loadscope-reorder keeps it; xdist would otherwise send the modules with the most tests first, the
#     unit tests, and leave the engine modules to the end, one worker finishing a long one while the others
#     idle). TIERCACHE_RECORD_MODULE_SECONDS=1 rewrites the file from the run. Three workers on two cores,
#     because much of a test's time is waiting (a server's health polls, its requests, Redis failovers), not
#     computing; a fourth made a whole run slower (19:04 against 18:19 on a 2-core VM). Three only since
#     OpenMP waits passively in the suite (tests/conftest.py): with vLLM's default spinning, engines on
#     shared cores slowed each other down.
#  2. the tests marked `serial`, one at a time, in a pytest of their own at normal priority. Their
#     assertions depend on time (a read timeout against a hung or failing-over server, a lookup budget),
#     so no second engine of theirs runs beside them, and pass 1 beside them is niced: the kernel gives
#     their processes a core first whenever both want one. Most of their four minutes is waiting out those
#     timeouts, which left the cores idle while they ran after pass 1. Their output follows pass 1's.
# Why side by side, and its cost: a fresh clone's `make test` on a quiet 2-core VM took 15:11 so, against
# 17:34 one pass after the other (pass 1 14:15 instead of 12:23, pass 2 4:32 beside it instead of 4:05).
# Where other work at normal priority keeps a core busy, niced pass 1 yields it that core: one busy core
# beside made a run 28:26 instead of 22:25. TIERCACHE_TEST_SEQUENTIAL=1 runs pass 2 after pass 1 instead,
# at normal priority both.
# Both passes always run; the script fails if either failed or collected nothing.
set -u
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
WORKERS=${TEST_WORKERS:-3}
NICE=${PASS1_NICE:-10}
ARGS=(-q -p no:cacheprovider --durations=15 "$@")
PASS1=("$PY" -m pytest "${ARGS[@]}" -n "$WORKERS" --dist loadscope --no-loadscope-reorder -m "not serial" tests)
PASS2=("$PY" -m pytest "${ARGS[@]}" -m serial tests)

if [ -n "${TIERCACHE_TEST_SEQUENTIAL:-}" ]; then
  echo "tiercache test: pass 1 of 2, tests not marked serial, on $WORKERS workers"
  "${PASS1[@]}"
  first=$?
  echo "tiercache test: pass 2 of 2, tests marked serial, one at a time"
  "${PASS2[@]}"
  second=$?
else
  SERIAL_LOG=$(mktemp "${TMPDIR:-/tmp}/tiercache-serial-pass.XXXXXX")
  # with job control on, so that its SIGINT is not ignored (a script's background commands ignore it): a
  # Ctrl-C stops pass 1, then the trap interrupts pass 2, which tears its servers down
  set -m
  "${PASS2[@]}" > "$SERIAL_LOG" 2>&1 &
  serial=$!
  set +m
  trap 'kill -INT "$serial" 2>/dev/null; wait "$serial"; rm -f "$SERIAL_LOG"; exit 130' INT TERM
  echo "tiercache test: pass 1 of 2, tests not marked serial, on $WORKERS workers (nice $NICE), pass 2 beside it"
  nice -n "$NICE" "${PASS1[@]}"
  first=$?
  echo "tiercache test: pass 2 of 2, tests marked serial, one at a time (ran beside pass 1)"
  wait "$serial"
  second=$?
  trap - INT TERM
  cat "$SERIAL_LOG"
  rm -f "$SERIAL_LOG"
fi
if [ "$first" -ne 0 ] || [ "$second" -ne 0 ]; then
  echo "tiercache test: FAILED (pass 1 exit $first, pass 2 exit $second; 5 means no test was collected)"
  exit 1
fi
