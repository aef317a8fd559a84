#!/usr/bin/env bash
# kvguard's cost on this round's paths, in a real SGLang 0.5.23 on one GPU (after `source bench/sglang_h200_setup.sh`):
# kvguard check vs off (two engines alive at once, runs in ABBA order, A/A from the off engine's own pairs;
# faultlab.sglang_gpu overhead), 8192 in / 1000 out, FP8 KV, page 16, c = 1 and 64, models in bench/models/.
#   CONFIGS="eagle eagle_nooverlap swa swa_spec mamba" TOTAL=570 [REPS=1:2,64:2] [REPS_eagle=64:2] bash bench/sglang_gpu_paths.sh
# Each engine gets mem_fraction_static MEM (0.42: two fit one 80 GB card). Raw results: $OUT/<config>/<config>.json; log: $OUT/run.log. A configuration that fails is logged and the next runs.
M=$PWD/bench/models
EAGLE='"speculative_algorithm": "EAGLE", "speculative_draft_model_path": "'$M'/llama3.2-1b-eagle-draft",
  "speculative_num_steps": 3, "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 4'
# GPT-OSS: SGLang picks the triton_kernels MoE runner when a triton_kernels package is found; the GPU machine's is
# partial (no triton_kernels.matmul): SGLang's own Triton fused MoE instead
MOE='"moe_runner_backend": "triton"'
# The SWA hybrid with speculative decoding: STANDALONE, the model drafting for itself (its own pools, SWA ones too)
SWASPEC='"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": "'$M'/gpt-oss-20b-attn",
  "speculative_num_steps": 3, "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 4'
declare -A MODEL=([eagle]=llama3.2-1b-shape [eagle_nooverlap]=llama3.2-1b-shape [swa]=gpt-oss-20b-attn
                  [swa_nooverlap]=gpt-oss-20b-attn [swa_spec]=gpt-oss-20b-attn [mamba]=qwen3-next-attn
                  [mamba_nooverlap]=qwen3-next-attn)
declare -A OVER=([eagle]="{$EAGLE}" [eagle_nooverlap]="{$EAGLE, \"disable_overlap_schedule\": true}"
                 [swa]="{$MOE}" [swa_nooverlap]="{$MOE, \"disable_overlap_schedule\": true}" [swa_spec]="{$MOE, $SWASPEC}"
                 [mamba]='{"disable_radix_cache": true}'
                 [mamba_nooverlap]='{"disable_radix_cache": true, "disable_overlap_schedule": true}')
L=$OUT/run.log
CONFIGS=(${CONFIGS:-eagle eagle_nooverlap swa mamba})
keep() { grep -a "^\[[0-9][0-9]:\|^c=\|^kvguard host\|Traceback\|Error\|error" | grep -v "Ignore import"; }
nvidia-smi -L >> $L
n=${#CONFIGS[@]}
for i in "${!CONFIGS[@]}"; do
  c=${CONFIGS[$i]}
  left=$(( ${TOTAL:-570} - SECONDS )); share=$(( left / (n - i) ))
  r=REPS_$c; reps=${!r:-${REPS:-1:2,64:2}}  # REPS_<config> over REPS
  echo "== $c at ${SECONDS}s (budget ${share}s)" >> $L
  [ $share -lt 120 ] && { echo "== $c skipped: ${share}s left" >> $L; continue; }
  timeout $((share + 30)) python3 -m faultlab.sglang_gpu overhead --out $OUT/$c --name $c.json \
    --model $M/${MODEL[$c]} --reps $reps --first-n 0 --mem-fraction ${MEM:-0.42} --budget $((share - 20)) \
    --start-timeout 240 --overrides "${OVER[$c]}" 2>&1 | keep >> $L
  echo "== $c exit ${PIPESTATUS[0]}" >> $L
done
echo "== done at ${SECONDS}s" >> $L
cat $L
