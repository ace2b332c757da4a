#!/usr/bin/env bash
# Run a foreground command (the newest release's engine tests, their output live) while make runs the
# given targets in the background, each target's output in LOGDIR/TARGET.log: the targets of one lane
# one after another, the lanes ("+" between them) side by side.
#
# Why: `make test` runs on a 2-core CI machine, and each pytest process keeps about one core busy (the
# engine tests are mostly single-threaded Python in the scheduler process, the others in pytest's).
# What needs nothing from the foreground (the suite's tests without engines, the older releases'
# checks, vLLM's venv and tests) runs beside it instead of after it, one target at a time per lane.
#
# Every target runs even after one failed (each log says what went wrong). At the end each target's
# result is printed: its log's last line, or its log's tail if it failed. Exit status: the
# foreground's if it failed (the background is stopped then, as a process group of its own, and
# waited for: nothing is left running); else 1 if a target failed; else 0.
#
# Usage: MAKE=make tests/infra/alongside.sh LOGDIR TARGET... [+ TARGET...]... -- COMMAND...
set -uo pipefail

usage() { echo "usage: MAKE=make $0 LOGDIR TARGET... [+ TARGET...]... -- COMMAND..." >&2; exit 2; }
[ $# -ge 1 ] || usage
logdir=$1
shift
targets=() lanes=() lane=()
while [ $# -gt 0 ] && [ "$1" != -- ]; do
    if [ "$1" = + ]; then
        [ ${#lane[@]} -gt 0 ] || usage
        lanes+=("${lane[*]}")
        lane=()
    else
        targets+=("$1")
        lane+=("$1")
    fi
    shift
done
[ ${#lane[@]} -gt 0 ] || usage
lanes+=("${lane[*]}")
[ $# -ge 2 ] || usage
shift

# The background: one target at a time, each leaving "EXIT-STATUS SECONDS" in LOGDIR/TARGET.status.
run_targets() {
    local logdir=$1 make=$2 target start
    shift 2
    for target in "$@"; do
        start=$SECONDS
        $make --no-print-directory "$target" >"$logdir/$target.log" 2>&1
        echo "$? $((SECONDS - start))" >"$logdir/$target.status"
    done
}

rm -rf "$logdir"
mkdir -p "$logdir"
background=()
for lane in "${lanes[@]}"; do
    echo "in the background, one at a time: $lane (output in $logdir/TARGET.log)"
    # setsid: a process group of its own, so that stopping it reaches every process it started.
    # shellcheck disable=SC2086 # a lane is its targets, split on spaces
    setsid bash -c "$(declare -f run_targets); run_targets \"\$@\"" run_targets "$logdir" "${MAKE:-make}" \
        $lane </dev/null &
    background+=($!)
done

stop_background() {
    local pid
    for pid in "${background[@]}"; do
        kill -TERM -- "-$pid" 2>/dev/null
    done
    for pid in "${background[@]}"; do
        for _ in $(seq 50); do
            kill -0 -- "-$pid" 2>/dev/null || break
            sleep 0.2
        done
        kill -KILL -- "-$pid" 2>/dev/null
        wait "$pid" 2>/dev/null
    done
    background=()
}
trap stop_background EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

"$@"
status=$?
if [ "$status" != 0 ]; then
    echo "$* failed (exit $status): stopping the background (its logs so far: $logdir)"
    exit "$status"
fi

for target in "${targets[@]}"; do
    [ -f "$logdir/$target.status" ] || { echo "waiting for the background (${targets[*]})"; break; }
done
wait "${background[@]}"
background=()

# A log's summary: pytest's last line ("== 45 passed in 43.1s ==", without its rulers; warnings
# printed at the interpreter's exit may follow it), else the last line that says something.
last_line() {
    local summary
    summary=$(grep -E '^=+ .* in [0-9.]+s( \(.*\))? =+$' "$1" | tail -n 1)
    [ -n "$summary" ] ||
        summary=$(grep -Ev '^[[:space:]]*$|^make(\[[0-9]+\])?: (Entering|Leaving) directory' "$1" | tail -n 1)
    sed 's/^=* *//; s/ *=*$//' <<<"$summary"
}

failed=()
for target in "${targets[@]}"; do
    log=$logdir/$target.log
    code=unknown seconds=0
    [ -f "$logdir/$target.status" ] && read -r code seconds <"$logdir/$target.status"
    took="$((seconds / 60)) min $((seconds % 60)) s"
    if [ "$code" = 0 ]; then
        echo "$target: ok ($took): $(last_line "$log")"
    else
        echo "$target: FAILED (exit $code, $took); the end of $log:"
        tail -n 40 "$log"
        failed+=("$target")
    fi
done
if [ ${#failed[@]} != 0 ]; then
    echo "failed in the background: ${failed[*]} (logs in $logdir)"
    exit 1
fi
