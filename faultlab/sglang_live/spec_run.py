"""A CPU ``sglang.Engine`` with EAGLE speculative decoding for faultlab's harness, and the clean-step sweep.

    python -m faultlab.sglang_live.spec_run OUT_DIR [--episodes 9] [--no-overlap] [--mode check]
        [--algorithm EAGLE|EAGLE3|NEXTN|STANDALONE] [--target mla] [--faults a,b]

runs fault-free episodes of :data:`SWEEP_WORKLOAD` on one EAGLE (3/1/4) engine through
:mod:`faultlab.sglang_live.harness` and prints the spec steps SGLang ran (faultlab's count of
``prepare_for_decode`` calls: one per verify step of the batch), the requests, and the requests that got an error
(a false abort with ``KVGUARD_MODE=check``). tests/test_faultlab/test_sglang_live/test_sglang_spec.py builds its
engines with :func:`engine_spec`.

What makes SGLang's spec path run on a plain CPU (tests only): SGLang's Triton attention backend and its spec tree
ops under Triton's interpreter (``TRITON_INTERPRET=1``; :mod:`.cpu_spec`), CUDA graphs off, a one-layer dummy EAGLE
draft (``LlamaForCausalLMEagle``; ``LlamaForCausalLMEagle3`` needs ``draft_vocab_size``); NEXTN (MTP) on a tiny
DeepSeek-V3 with one MTP layer (multi-head latent attention), its own draft. ``--target mla``: an EAGLE or EAGLE3
draft (the tiny Llama's width and vocabulary) in front of a tiny DeepSeek-V2 (MLA) target instead of the tiny Llama.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from .harness import TINY_DEEPSEEK_MTP, TINY_MLA, spawn, write_model
from .plan import ENV_CPU_SPEC

CHAIN = {"speculative_num_steps": 3, "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 4}
DRAFTS = {"EAGLE": {"architectures": ["LlamaForCausalLMEagle"], "num_hidden_layers": 1},
          "EAGLE3": {"architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 1, "draft_vocab_size": 1000},
          # the target's own config: the same dummy weights (seeded by name), so its drafts are accepted
          "STANDALONE": {},
          # no draft of its own: the target is a DeepSeek-V3 with an MTP layer (MLA), which SGLang drafts with
          # (NEXTN resolves to EAGLE, the draft path to the model's own, its architecture to ...NextN)
          "NEXTN": None}
TARGETS = {"NEXTN": TINY_DEEPSEEK_MTP}  # a target other than the tiny Llama
TARGET_MODELS = {"llama": None, "mla": TINY_MLA}  # --target (None: the algorithm's own, TARGETS)
WORKLOAD = {"n1": 3, "n2": 0, "prefix": 24, "new1": 12, "new2": 4}  # a test episode: few requests, few steps
SWEEP_WORKLOAD = {"n1": 8, "n2": 0, "prefix": 24, "new1": 120, "new2": 4}  # ~100 verify steps of 8 requests each


def engine_spec(folder: str, *, overlap: bool, mode: str, episodes: list, algorithm: str = "EAGLE",
                workload: dict | None = None, target: str = "llama") -> dict:
    """The harness spec of a CPU EAGLE engine (page size 1, chain 3/1/4), its draft model written into ``folder``
    (``target``: a key of :data:`TARGET_MODELS`; an algorithm without a draft of its own keeps its own target)."""
    if target not in TARGET_MODELS or (target != "llama" and DRAFTS[algorithm] in (None, {})):
        raise ValueError(f"target {target!r}: one of {sorted(TARGET_MODELS)}, and only with EAGLE or EAGLE3")
    draft = None if DRAFTS[algorithm] is None else \
        write_model(os.path.join(folder, f"draft_{algorithm.lower()}"), DRAFTS[algorithm])
    return {"device": "cpu", "page_size": 1, "overlap": overlap, "attention_backend": "triton",
            "env": {"KVGUARD_MODE": mode, "TRITON_INTERPRET": "1", ENV_CPU_SPEC: "1"},
            "workload": {**WORKLOAD, **(workload or {})}, "model": TARGET_MODELS[target] or TARGETS.get(algorithm),
            # NOTE: one KV split per request in the Triton decode kernel: fewer interpreted programs (a speed knob)
            "engine": {"speculative_algorithm": algorithm, **CHAIN, "disable_cuda_graph": True,
                       "triton_attention_num_kv_splits": 1,
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
    parser.add_argument("--target", default="llama", choices=sorted(TARGET_MODELS))
    parser.add_argument("--faults", default="", help="comma-separated spec faults, one episode each, after the clean ones")
    parser.add_argument("--timeout", type=float, default=3 * 3600)
    args = parser.parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    episodes = [{"label": f"sweep{i}", "fault": None} for i in range(args.episodes)]
    episodes += [{"label": f.replace("_", ""), "fault": f, "seed": 1} for f in args.faults.split(",") if f]
    spec = engine_spec(args.out_dir, overlap=not args.no_overlap, mode=args.mode, episodes=episodes,
                       algorithm=args.algorithm, workload=SWEEP_WORKLOAD if not args.faults else None,
                       target=args.target)
    rc, result, stderr = spawn(spec, args.out_dir, "sweep", args.timeout)
    out = {"rc": rc, **(summary(result) if result else {"error": stderr[-2000:]})}
    print(json.dumps(out))
    return 0 if rc == 0 and result and passed(out) else 1


if __name__ == "__main__":
    sys.exit(main())
