#!/usr/bin/env bash
# The test suite, as `make test` runs it: three pytest runs, two at a time.
#  - tests/e2e (real vLLM servers, each ~1 min to start) in the background, its report kept in a file and shown
#    at the end: most of its time is spent waiting for servers, so it overlaps well with
#  - everything else except the ucx tests, then
#  - the ucx tests, in a process of their own (ucxx's bundled UCX and NIXL's cannot share one process).
# Any pytest argument given here goes to all three runs. Exit status: the first non-zero one of the three.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
log=$(mktemp "${TMPDIR:-/tmp}/kvxfer-e2e.XXXXXX")
$PY -m pytest -m "not ucx" tests/e2e "$@" >"$log" 2>&1 &
e2e=$!
# an interrupted run ends its end-to-end half too (tests/e2e turns SIGTERM into an interrupt: servers stopped)
trap 'kill $e2e 2>/dev/null' EXIT
$PY -m pytest -m "not ucx" --ignore=tests/e2e "$@"
rest=$?
$PY -m pytest -m ucx "$@"
ucx=$?
echo "=== waiting for the end-to-end tests (running beside the above; their report: $log)"
wait $e2e
e2e_rc=$?
trap - EXIT
cat "$log"
echo "=== exit status: rest $rest, ucx $ucx, e2e $e2e_rc"
for rc in $rest $ucx $e2e_rc; do
  [ "$rc" -eq 0 ] || exit "$rc"
done
