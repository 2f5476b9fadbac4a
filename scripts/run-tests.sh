#!/usr/bin/env bash
# The test suite, as `make test` runs it.
#  1. Alone, first: the tests marked `quiet` (they end throttled transfers midway, which a busy machine spoils),
#     those over ucx in a process of their own as below.
#  2. Then two at a time: tests/e2e (real vLLM servers, each ~1 min to start) in the background, its report kept
#     in a file and shown at the end; beside it everything else but the ucx tests, then the ucx tests in a
#     process of their own (ucxx's bundled UCX and NIXL's cannot share one process).
# Any pytest argument given here goes to every run (one that selects no test of a run is fine: pytest's 5 counts
# as 0). Exit status: the first non-zero one.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
status=()
record() { status+=($(($1 == 5 ? 0 : $1))); }
$PY -m pytest -m "quiet and not ucx" "$@"
record $?
$PY -m pytest -m "quiet and ucx" "$@"
record $?
log=$(mktemp "${TMPDIR:-/tmp}/kvxfer-e2e.XXXXXX")
$PY -m pytest -m "not ucx and not quiet" tests/e2e "$@" >"$log" 2>&1 &
e2e=$!
# an interrupted run ends its end-to-end half too (tests/e2e turns SIGTERM into an interrupt: servers stopped)
trap 'kill $e2e 2>/dev/null' EXIT
$PY -m pytest -m "not ucx and not quiet" --ignore=tests/e2e "$@"
record $?
$PY -m pytest -m "ucx and not quiet" "$@"
record $?
echo "=== waiting for the end-to-end tests (running beside the above; their report: $log)"
wait $e2e
record $?
trap - EXIT
cat "$log"
echo "=== exit status: quiet ${status[0]}, quiet ucx ${status[1]}, rest ${status[2]}, ucx ${status[3]}, e2e ${status[4]}"
for rc in "${status[@]}"; do
  [ "$rc" -eq 0 ] || exit "$rc"
done
