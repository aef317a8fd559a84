#!/usr/bin/env bash
# One call on the 2-GPU (or, with TP=4, the 4-GPU) machine (run from .snap after sourcing bench/sglang_h200_setup.sh): the
# single-GPU live-fault run, TP=2 fault runs (rank-local and all-rank) at the same time, then TP=2
# overhead (c=8, c=64), then INT4 vs BF16 weights if time is left. Logs: $OUT/run.log.
B="python3 -m faultlab.sglang_gpu"
TP=${TP:-2}   # TP=4 on the 4-GPU machine
L=$OUT/run.log
nvidia-smi -L >> $L
$B faults --out $OUT --name faults_h200.json --seeds 3 --off-seeds 1 --split-killers --spread-gpus $TP --budget 190 > /tmp/f1.log 2>&1 &
sleep 50
$B faults --out $OUT --name faults_tp${TP}_rank1.json --tp $TP --fault-rank 1 --classes swapped_entries,index_shift,in_page_entry --seeds 2 --off-seeds 0 --page-sizes 16 --budget 140 > /tmp/f2.log 2>&1 &
$B faults --out $OUT --name faults_tp${TP}_all.json --tp $TP --classes swapped_entries,index_shift,premature_free,stale_row --seeds 2 --off-seeds 0 --page-sizes 16 --budget 140 > /tmp/f3.log 2>&1 &
wait
for f in /tmp/f1.log /tmp/f2.log /tmp/f3.log; do echo "== $f" >> $L; grep -a "^\[[0-9][0-9]:" $f >> $L; done
grep -a -h "Traceback\|Error" /tmp/faults_*.log | sort | uniq -c | head -20 >> $L
echo "== overhead tp$TP at ${SECONDS}s" >> $L
$B overhead --out $OUT --name overhead_tp${TP}.json --tp $TP --reps 8:2,64:1 --first-n 2 --first-output 16 --budget 200 --est 8:7,64:30 --log-level info > /tmp/o.log 2>&1
grep -a "^\[[0-9][0-9]:\|^ *[0-9]* |\|^kvguard host\|Traceback\|Error" /tmp/o.log | grep -v "Ignore import" >> $L
echo "== int4 at ${SECONDS}s" >> $L
if [ $SECONDS -lt 400 ]; then
  CUDA_VISIBLE_DEVICES=0 $B extras --out $OUT --name extras_int4.json --kv-dtypes "" --need-first 1e9 --need-int4 40 --int4-start-timeout 100 --budget $((480 - SECONDS)) --log-level info > /tmp/e.log 2>&1
  grep -a "^\[[0-9][0-9]:\|marlin\|Traceback\|Error" /tmp/e.log | grep -v "Ignore import" | tail -20 >> $L
fi
echo "== done at ${SECONDS}s" >> $L
cat $L
