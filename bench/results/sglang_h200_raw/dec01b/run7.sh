#!/usr/bin/env bash
# call 7 (one H200): overhead at 8192 in / 1000 out with the stale-row fix (5d3856b: one more hook,
# Scheduler.update_running_batch, per decode step), c=1 x4 and c=64 x2 A/B pairs with A/A, and kvguard's
# host time per iteration (every kvguard hook profiled, the new one included).
cd "$(dirname "$0")"
export SGL_BUNDLE=$PWD/../.sgl
source bench/sglang_h200_setup.sh || exit 1
mkdir -p /tmp/r
python3 -m faultlab.sglang_gpu overhead --out /tmp/r --name overhead_repeat.json --reps 1:4,64:2 --est 1:8,64:44 --first-n 2 --first-output 16 --budget 430 --log-level info > /tmp/r/o.log 2>&1
grep -a "^\[[0-9][0-9]:\|^ *[0-9]* |\|^kvguard host\|Traceback\|Error" /tmp/r/o.log | grep -v "Ignore import" | tail -40
ls /tmp/r
tar czf $OUT/run7.tgz -C /tmp r
