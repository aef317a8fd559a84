#!/usr/bin/env bash
# call 5 (x2, commit fb3a621, before the fix): stale_row diagnosis with the twin control (sglang_abort) and
# the KV watch, page 16 and 1. GPU0: default engine settings; GPU1: SGLang's deterministic inference.
cd "$(dirname "$0")"
export SGL_BUNDLE=$PWD/../.sgl
source bench/sglang_h200_setup.sh || exit 1
mkdir -p /tmp/r
B="python3 -m faultlab.sglang_gpu"
W='{"FAULTLAB_SGLANG_KV_WATCH": "1"}'
run() { CUDA_VISIBLE_DEVICES=$1 $B faults --out /tmp/r --name $2.json --classes stale_row,sglang_abort --seeds 4 --off-seeds 0 --page-sizes 16,1 --fault-mem-fraction 0.3 --budget 420 --env "$W" --overrides "$3" > /tmp/r/$2.log 2>&1; }
run 0 twin_default '{}' &
run 1 twin_determ '{"enable_deterministic_inference": true}' &
wait
tar czf $OUT/run5.tgz -C /tmp r
