#!/usr/bin/env bash
# One call on the H200 (after sourcing bench/sglang_h200_setup.sh): kvguard's per-step check on and off in
# alternate blocks of 8 decode steps within each run (overhead --interleave), 8192 in / 1000 out, FP8 KV, page 16,
# first with the overlap scheduler off, then on (ON_REPS=none: off only). Raw results: $OUT/off, $OUT/on; log:
# $OUT/run.log. EXTRA: more harness options for both (e.g. --tp-path: kvguard's attention-TP path on one rank).
B="python3 -m faultlab.sglang_gpu overhead --interleave ${BLOCK:-8} --first-n 0 ${EXTRA:-}"
L=$OUT/run.log
keep() { grep -a "^\[[0-9][0-9]:\|^ *[0-9]* |\|interleaved steps\|^c=\|^kvguard host\|Traceback\|Error" | grep -v "Ignore import"; }
nvidia-smi -L >> $L
echo "== overlap off" >> $L
$B --out $OUT/off --name overhead_interleave_nooverlap.json --reps ${OFF_REPS:-1:3,64:2} --budget ${OFF_BUDGET:-300} \
  --overrides '{"disable_overlap_schedule": true}' 2>&1 | keep >> $L
if [ "${ON_REPS:-}" != none ]; then
  echo "== overlap on at ${SECONDS}s" >> $L
  $B --out $OUT/on --name overhead_interleave_overlap.json --reps ${ON_REPS:-1:2,64:1} \
    --budget $((${TOTAL:-540} - SECONDS)) 2>&1 | keep >> $L
fi
rm -f $OUT/*/kvguard_switch*
echo "== done at ${SECONDS}s" >> $L
cat $L
