#!/usr/bin/env bash
# `make test`'s pytest run: usage scripts/test-lanes.sh PYTHON WORKERS [pytest args...]
#
# The suite is bound by CPU on a 2-core machine, yet its two xdist workers leave the cores idle
# whenever both wait on their processes (a control plane down for 30 s, a job's steps, a timeout).
# So it runs in two lanes at once (tests/conftest.py, lane_of):
# - heavy: the end-to-end tests and every module that starts a process or a thread or waits on
#   time, on WORKERS pytest-xdist workers, as before;
# - light: the rest (pure logic, hypothesis properties, in-process API tests on PostgreSQL), in one
#   process under SCHED_IDLE (`chrt --idle 0`; `nice 19` where chrt is missing): it runs only on
#   CPU the heavy lane leaves. At `nice 10` it took enough to slow the first end-to-end tests by
#   30-40 s each (docs/benchmarks.md, "make test").
# The light lane writes to a log of its own, printed when it ends; the run fails if either fails.
# TEST_LANES_CHECKS, a shell command (make test: mypy and the import contracts), runs first in the
# light lane, at its priority: its 30-odd CPU-s then come out of idle time instead of before the
# suite; if it fails, the light lane's tests do not run and the run fails with its output.
# WORKERS=0 runs the checks, then the whole suite in one process, without lanes.
set -uo pipefail

py=$1
workers=$2
shift 2

# pytest rewrites each test module's asserts and caches the result in __pycache__ (git-ignored):
# with PYTHONDONTWRITEBYTECODE set, every session and xdist worker would redo it, and every process
# the suite starts would compile the platform's modules again.
unset PYTHONDONTWRITEBYTECODE

checks=${TEST_LANES_CHECKS:-true}
if [ "$workers" = "0" ]; then
    bash -c "$checks" || exit 1
    exec "$py" -m pytest -q "$@"
fi

# A basetemp of its own: two sessions would otherwise share /tmp/pytest-of-$USER, and each resets
# its mode at start, under the other's agents.
light_dir=$(mktemp -d "${TMPDIR:-/tmp}/trainyard-light-lane.XXXXXX")
light_log=$light_dir/pytest.log
checks_log=$light_dir/checks.log
idle=(nice -n 19)
if command -v chrt >/dev/null && chrt --idle 0 true 2>/dev/null; then idle=(chrt --idle 0); fi
(
    "${idle[@]}" bash -c "$checks" >"$checks_log" 2>&1 || exit 2
    TRAINYARD_TEST_LANE=light exec "${idle[@]}" "$py" -m pytest -q -p no:cacheprovider \
        --basetemp="$light_dir/tmp" "$@" >"$light_log" 2>&1
) &
light_pid=$!
trap 'pkill -INT -P "$light_pid" 2>/dev/null; kill -INT "$light_pid" 2>/dev/null; wait "$light_pid" 2>/dev/null; rm -rf "$light_dir"' EXIT
trap 'exit 130' INT TERM

echo "light lane: the checks ($checks), then pytest, in the background (${idle[*]}); log $light_log"
TRAINYARD_TEST_LANE=heavy "$py" -m pytest -q -n "$workers" --dist worksteal "$@"
heavy_rc=$?

wait "$light_pid"
light_rc=$?
echo "== the checks"
cat "$checks_log"
echo "== light lane (exit $light_rc)"
if [ "$light_rc" -eq 2 ] && [ ! -s "$light_log" ]; then
    echo "the checks failed: the light lane's tests did not run"
elif [ "$light_rc" -eq 0 ]; then
    # Its summary: the slowest tests, skips and the counts.
    sed -n '/slowest [0-9]* durations/,$p' "$light_log"
else
    cat "$light_log"
fi
echo "== heavy lane exit $heavy_rc, light lane exit $light_rc"
[ "$heavy_rc" -eq 0 ] && [ "$light_rc" -eq 0 ]
