"""A CPU ``sglang.Engine`` with EAGLE speculative decoding for faultlab's harness, and the clean-step sweep.

    python -m faultlab.sglang_live.spec_run OUT_DIR [--episodes 9] [--no-overlap] [--mode check]
        [--algorithm EAGLE|EAGLE3|NEXTN|STANDALONE] [--target mla|glm|nemotron_h] [--faults a,b]

runs fault-free episodes of :data:`SWEEP_WORKLOAD` on one EAGLE (3/1/4) engine through
:mod:`faultlab.sglang_live.harness` and prints the spec steps SGLang ran (faultlab's count of
``prepare_for_decode`` calls: one per verify step of the batch), the requests, and the requests that got an error
(a false abort with ``KVGUARD_MODE=check``). tests/test_faultlab/test_sglang_live/test_sglang_spec.py builds its
engines with :func:`engine_spec`.

What makes SGLang's spec path run on a plain CPU (tests only): SGLang's Triton attention backend and its spec tree
ops under Triton's interpreter (``TRITON_INTERPRET=1``; :mod:`.cpu_spec`), CUDA graphs off, a one-layer dummy EAGLE
draft (``LlamaForCausalLMEagle``; ``LlamaForCausalLMEagle3`` needs ``draft_vocab_size``); NEXTN (MTP) on a tiny
DeepSeek-V3 with one MTP layer (multi-head latent attention), its own draft. ``--target mla``: an EAGLE or EAGLE3
draft (the tiny Llama's width and vocabulary) in front of a tiny DeepSeek-V2 (MLA) target instead of the tiny Llama;
with NEXTN, ``--target glm``: a tiny GLM-4.5 (grouped-query attention) with an MTP layer instead of the DeepSeek-V3;
``--target nemotron_h``: a tiny NemotronH (mamba2 beside attention, a hybrid state pool) with an MTP layer.
``--swa``: a tiny GPT-OSS (sliding-window layers beside full ones) as the target, page 16.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from .families import GLM4_MOE_MTP, GPT_OSS, NEMOTRON_H_MTP
from .harness import TINY_DEEPSEEK_MTP, TINY_MLA, spawn, write_model
from .plan import ENV_CPU_SPEC

CHAIN = {"speculative_num_steps": 3, "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 4}
DRAFTS = {"EAGLE": {"architectures": ["LlamaForCausalLMEagle"], "num_hidden_layers": 1},
          # (SGLang's default capture layers [2, n // 2, n - 3] do not exist in a 2-layer target: name them)
          "EAGLE3": {"architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 1, "draft_vocab_size": 1000,
                     "eagle_config": {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": [0, 1]}},
          # the target's own config: the same dummy weights (seeded by name), so its drafts are accepted
          "STANDALONE": {},
          # no draft of its own: the target has an MTP layer, which SGLang drafts with (NEXTN resolves to EAGLE, the
          # draft path to the model's own, its architecture to ...NextN)
          "NEXTN": None}
# --target: the target model, by the drafts' kind. A draft model of its own (EAGLE, EAGLE3; STANDALONE: llama only)
# in front of the tiny Llama (None) or a tiny DeepSeek-V2 (MLA); NEXTN: a tiny DeepSeek-V3 (MLA, the default) or a
# tiny GLM-4.5 (grouped-query attention), each with one MTP layer
TARGET_MODELS = {"llama": None, "mla": TINY_MLA}
MTP_TARGETS = {"llama": TINY_DEEPSEEK_MTP, "mla": TINY_DEEPSEEK_MTP, "glm": GLM4_MOE_MTP,
               "nemotron_h": NEMOTRON_H_MTP}
TARGET_NAMES = sorted(set(TARGET_MODELS) | set(MTP_TARGETS))
HYBRID_TARGETS = ("nemotron_h",)  # linear-attention state beside attention (engine_spec sets its CPU path up)
WORKLOAD = {"n1": 3, "n2": 0, "prefix": 24, "new1": 12, "new2": 4}  # a test episode: few requests, few steps
SWEEP_WORKLOAD = {"n1": 8, "n2": 0, "prefix": 24, "new1": 120, "new2": 4}  # ~100 verify steps of 8 requests each


def engine_spec(folder: str, *, overlap: bool, mode: str, episodes: list, algorithm: str = "EAGLE",
                workload: dict | None = None, target: str = "llama", model: dict | None = None) -> dict:
    """The harness spec of a CPU EAGLE engine (page size 1, chain 3/1/4), its draft model written into ``folder``
    (``target``: a key of :data:`TARGET_MODELS`, or of :data:`MTP_TARGETS` for NEXTN).
    ``model``: a target config of :data:`faultlab.sglang_live.families` instead (STANDALONE drafts with it too)."""
    mtp = DRAFTS[algorithm] is None
    if target not in (MTP_TARGETS if mtp else TARGET_MODELS) or (target != "llama" and DRAFTS[algorithm] == {}):
        raise ValueError(f"target {target!r}: one of {sorted(TARGET_MODELS)} with EAGLE or EAGLE3 (llama with "
                         f"STANDALONE), one of {sorted(MTP_TARGETS)} with NEXTN")
    if model is not None and (target != "llama" or mtp):
        raise ValueError(f"model: a target of its own, not with --target {target!r} or {algorithm}")
    draft = None if DRAFTS[algorithm] is None else \
        write_model(os.path.join(folder, f"draft_{algorithm.lower()}"), DRAFTS[algorithm] or model)
    hybrid = {}
    if target in HYBRID_TARGETS:  # a hybrid state pool: SGLang's mamba kernels on the CPU, the no_buffer strategy
        # (SGLang refuses it with the overlap scheduler), radix cache off
        from .cpu_mamba import ENV_VAR as ENV_CPU_MAMBA
        from .cpu_mamba_spec import ENV_VAR as ENV_CPU_MAMBA_SPEC

        overlap, hybrid = False, {"radix": False, "env": {ENV_CPU_MAMBA: "1", ENV_CPU_MAMBA_SPEC: "1"},
                                  "engine": {"mamba_radix_cache_strategy": "no_buffer"}}
    return {"device": "cpu", "page_size": 1, "overlap": overlap, "attention_backend": "triton",
            "radix": hybrid.get("radix", True),
            "env": {"KVGUARD_MODE": mode, "TRITON_INTERPRET": "1", ENV_CPU_SPEC: "1", **hybrid.get("env", {})},
            "workload": {**WORKLOAD, **(workload or {})},
            "model": model or (MTP_TARGETS[target] if mtp else TARGET_MODELS[target]),
            # NOTE: one KV split per request in the Triton decode kernel: fewer interpreted programs (a speed knob)
            "engine": {"speculative_algorithm": algorithm, **CHAIN, "disable_cuda_graph": True,
                       "triton_attention_num_kv_splits": 1, **hybrid.get("engine", {}),
                       **({} if draft is None else {"speculative_draft_model_path": draft})},
            "episodes": episodes}


def summary(result: dict) -> dict:
    """Spec steps run, requests, the fault-free episodes' requests that got an error (false aborts), and what is wrong
    with each fault episode against the first fault-free one (:func:`faultlab.sglang_live.sweep.judge`: exactly the
    injector's victims aborted, the others' tokens equal, pools balanced; empty: exact)."""
    from .sweep import judge

    eps = result.get("episodes", [])
    steps = max([e["idle_check"]["decode_steps"] for e in eps if e.get("idle_check")] or [0])
    clean = [e for e in eps if not e.get("fault")]
    errors = [r["rid"] for e in clean for r in e["requests"] if r["error"]]
    faults = {e["label"]: {"victims": e.get("victims", []), "problems": judge(e, clean[0]) if clean else ["no clean"]}
              for e in eps if e.get("fault")}
    return {"episodes": len(eps), "spec_steps": steps, "requests": sum(len(e["requests"]) for e in eps),
            "errors": errors, "faults": faults,
            "balanced": all(e["idle_check"] and e["idle_check"]["balanced"] for e in eps),
            "startup_s": result.get("startup_s"), "seconds": sum(e["seconds"] for e in eps)}


def passed(out: dict) -> bool:
    """No false abort, pools balanced, every fault episode exact."""
    return (not out.get("errors") and out.get("balanced", False) and out.get("episodes", 0) > 0
            and not any(f["problems"] for f in out.get("faults", {}).values()))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--episodes", type=int, default=9)
    parser.add_argument("--no-overlap", action="store_true")
    parser.add_argument("--mode", default="check")
    parser.add_argument("--algorithm", default="EAGLE", choices=sorted(DRAFTS))
    parser.add_argument("--target", default="llama", choices=TARGET_NAMES)
    parser.add_argument("--swa", action="store_true",
                        help="the target: a tiny GPT-OSS (sliding-window layers beside full ones), page 16, SGLang's "
                             "CUDA branch of SWA frees (with --algorithm STANDALONE it drafts with itself; EAGLE: the "
                             "one-layer Llama draft)")
    parser.add_argument("--faults", default="", help="comma-separated spec faults, one episode each, after the clean ones")
    parser.add_argument("--timeout", type=float, default=3 * 3600)
    args = parser.parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    episodes = [{"label": f"sweep{i}", "fault": None} for i in range(args.episodes)]
    episodes += [{"label": f.replace("_", ""), "fault": f, "seed": 1} for f in args.faults.split(",") if f]
    if args.swa and (args.target != "llama" or args.algorithm not in ("STANDALONE", "EAGLE")):
        parser.error("--swa: with --algorithm STANDALONE or EAGLE, and no --target")
    spec = engine_spec(args.out_dir, overlap=not args.no_overlap, mode=args.mode, episodes=episodes,
                       algorithm=args.algorithm, workload=SWEEP_WORKLOAD if not args.faults else None,
                       target=args.target, model=GPT_OSS if args.swa else None)
    if args.swa:  # (as tests/test_faultlab/test_sglang_live/test_sglang_swa_spec.py runs it)
        from .cpu_swa import ENV_VAR as ENV_SWA_CUDA_FREE

        spec["page_size"] = 16
        spec["env"][ENV_SWA_CUDA_FREE] = "1"
    rc, result, stderr = spawn(spec, args.out_dir, "sweep", args.timeout)
    out = {"rc": rc, **(summary(result) if result else {"error": stderr[-2000:]})}
    print(json.dumps(out))
    return 0 if rc == 0 and result and passed(out) else 1


if __name__ == "__main__":
    sys.exit(main())
