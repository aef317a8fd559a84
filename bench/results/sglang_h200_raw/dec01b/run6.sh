#!/usr/bin/env bash
# call 6 (one H200; the x2 kind was not lent): the stale-row fix (kvguard aborts a stale-row request in
# Scheduler.update_running_batch, before its next decode step), measured:
# f1: every fault class + stale_row's twin control, kvguard check at page 16 and 1 (+ off at 16), 4 seeds;
# f2: stale_row + twin with the KV watch (per-position K/V of the new owner vs the twin and the fault-free run).
cd "$(dirname "$0")"
export SGL_BUNDLE=$PWD/../.sgl
source bench/sglang_h200_setup.sh || exit 1
mkdir -p /tmp/r
B="python3 -m faultlab.sglang_gpu"
$B faults --out /tmp/r --name faults_h200.json --seeds 4 --off-seeds 1 --split-killers --fault-mem-fraction 0.08 --budget 330 > /tmp/r/f1.log 2>&1 &
sleep 60
$B faults --out /tmp/r --name stale_watch.json --classes stale_row,sglang_abort --seeds 4 --off-seeds 0 --page-sizes 16,1 --fault-mem-fraction 0.08 --budget 240 --env '{"FAULTLAB_SGLANG_KV_WATCH": "1"}' > /tmp/r/f2.log 2>&1 &
wait
echo "== done at ${SECONDS}s"
for f in f1 f2; do echo "== $f"; grep -a "^\[[0-9][0-9]:" /tmp/r/$f.log | tail -12; done
grep -a -h "Traceback\|Error" /tmp/faults_*.log /tmp/stale_watch*.log | sort | uniq -c | head -10
python3 - <<'PY'
import json
for n in ("faults_h200", "stale_watch"):
    try:
        d = json.load(open(f"/tmp/r/{n}.json"))
    except Exception as e:
        print(n, "no result", e); continue
    for e in d["engines"]:
        rows = e["episodes"]
        print("==", n, e["name"], "rc", e["rc"], e["completed"], "/", e["planned"])
        for r in rows:
            if r["fault"] == "none": continue
            print("  ", r["label"], "v", r["victims"], "ab", r["victims_aborted"], "fa", r["false_aborts"], "m", r["non_victim_mismatches"],
                  "twin_m", r.get("twin_mismatches"), "shared", r.get("shared_row_steps"), "bal", r["balanced"],
                  r.get("kv_events", ""), r.get("kv_first_diff", ""))
PY
cp /tmp/stale_watch_*.json /tmp/r/ 2>/dev/null
tar czf $OUT/run6.tgz -C /tmp r
