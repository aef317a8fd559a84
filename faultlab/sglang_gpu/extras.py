"""``extras``: FP8 vs BF16 KV (tokens that fit, peak decode), the first requests after start with warm
caches, INT4 vs BF16 weights (single-stream decode)."""
from __future__ import annotations

import os
import time

from faultlab.sglang_gpu.common import (
    BUNDLE_MODELS,
    command_line,
    dump,
    engine_kwargs,
    environment,
    log,
    model_dir,
    setup_env,
    slim,
    start_engines,
    stop_all,
    vocab_of,
)


def cmd_extras(a) -> None:
    """In order, each step skipped when --budget would be exceeded:

    1. FP8 KV engine (kvguard off, --mem-fraction): tokens that fit (SGLang's max_total_num_tokens); its
       first batch after start (cold compile caches on a fresh machine); peak decode throughput: as many
       8192+out requests as fit (up to --peak-cap), submitted at once (SGLang prefills waiting requests
       before decoding, so the decode steps run at the full batch): requests / median inter-token latency.
    2. The same with BF16 KV.
    3. First requests after start, caches warm: a fresh kvguard-check engine and a fresh off engine
       (FP8 KV), the same batch twice on each (first vs second, check vs off).
    4. INT4 (GPTQ config, SGLang picks gptq_marlin, dummy weights) vs BF16 weights, single-stream decode,
       CUDA graphs off or (--weight-graphs) on; start capped. On a fresh machine the INT4 engine's first
       forward JIT-compiles the Marlin kernels (~6 min seen): with graphs that happens at start.
    """
    setup_env(a)
    model = model_dir(a)
    vocab = vocab_of(model)
    t0 = time.perf_counter()
    result = {"command": command_line(a),
              "environment": environment(), "input_len": a.input_len}
    ctx = a.input_len + a.peak_output + a.page_size

    def left() -> float:
        return a.budget - (time.perf_counter() - t0) if a.budget else 1e9

    def save():
        dump(a, a.name, result)

    first_w = dict(n=a.first_n, input_len=a.input_len, output_len=a.first_output, seed=a.seed + 7, vocab=vocab)
    # -- 1, 2: KV dtypes --------------------------------------------------------------------------------
    kv = {}
    for dt in [x for x in a.kv_dtypes.split(",") if x]:
        if left() < a.need_kv:
            kv[dt] = {"skipped": f"budget ({left():.0f} s left)"}
            continue
        kw = engine_kwargs(a, model=model, kv_dtype=dt, max_running=a.peak_cap, graph_bs=a.peak_cap)
        w = None
        try:
            w = start_engines([(f"kv-{dt}", {"KVGUARD_MODE": "off"}, kw)], a.start_timeout)[f"kv-{dt}"]
            info = dict(w.info)
            fit = int(info["max_total_num_tokens"])
            entry = {"engine": info, "max_total_num_tokens": fit, "requests_fit_at_context": fit // ctx}
            r1 = w.run(tag=f"first-{dt}", **first_w)
            entry["first_batch_s"], entry["first_batch_ttft_p99"] = r1["wall_s"], r1["ttft_p99"]
            c = max(1, min(fit // ctx, a.peak_cap, int(info.get("internal_state", {}).get("max_running_requests") or a.peak_cap)))
            if a.cpu:
                c = min(c, 4)
            r = w.run(n=c, input_len=a.input_len, output_len=a.peak_output, seed=a.seed, vocab=vocab, tag=f"peak-{dt}")
            entry.update(peak_concurrency=c, peak_run=slim(r), peak_decode_tok_s=c / r["itl_p50"],
                         peak_itl_p50_ms=1e3 * r["itl_p50"])
            log(f"KV {dt}: {fit} tokens fit ({fit // ctx} requests of {ctx}); first batch {r1['wall_s']:.2f} s; "
                f"peak decode at c={c}: {c / r['itl_p50']:.0f} tok/s (ITL p50 {1e3 * r['itl_p50']:.2f} ms)")
            kv[dt] = entry
        except Exception as e:  # noqa: BLE001 - report and go on
            kv[dt] = {"error": str(e)[-2000:]}
            log(f"KV {dt}: failed: {str(e)[-500:]}")
        finally:
            if w is not None:
                w.stop()
        result["kv_dtypes"] = kv
        save()
    # -- 3: first requests after start, caches warm -------------------------------------------------------
    if left() > a.need_first:
        first = {}
        kw = engine_kwargs(a, model=model, max_total_tokens=a.first_n * ctx + 64 * a.page_size,
                           max_running=a.first_n, graph_bs=a.first_n)
        workers = {}
        try:
            workers = start_engines([("check", {"KVGUARD_MODE": "check"}, kw), ("off", {"KVGUARD_MODE": "off"}, kw)],
                                    a.start_timeout)
            for mode in ("check", "off"):
                r1 = workers[mode].run(tag=f"first-{mode}", **first_w)
                r2 = workers[mode].run(tag=f"second-{mode}", **first_w)
                first[mode] = {"start_s": workers[mode].info["start_s"], "first": slim(r1), "second": slim(r2)}
                log(f"warm-cache first batch {mode}: {r1['wall_s']:.3f} s (ttft p99 {r1['ttft_p99']:.3f}), "
                    f"second {r2['wall_s']:.3f} s (ttft p99 {r2['ttft_p99']:.3f}); start {workers[mode].info['start_s']:.1f} s")
        except Exception as e:  # noqa: BLE001
            first["error"] = str(e)[-2000:]
            log(f"first requests: failed: {str(e)[-500:]}")
        finally:
            stop_all(workers)
        result["first_requests_warm_cache"] = first
        save()
    else:
        result["first_requests_warm_cache"] = {"skipped": f"budget ({left():.0f} s left)"}
    # -- 4: INT4 vs BF16 weights --------------------------------------------------------------------------
    weights = {}
    for label, name in (("int4_gptq", "llama3-8b-gptq"), ("bf16", "llama3-8b-shape")):
        if label not in a.weights.split(","):
            continue
        if left() < a.need_int4:
            weights[label] = {"skipped": f"budget ({left():.0f} s left)"}
            continue
        mdir = os.path.join(BUNDLE_MODELS, "tiny-llama" if a.cpu else name)
        kw = engine_kwargs(a, model=mdir, max_total_tokens=8 * 1024, max_running=4,
                           **({"cuda_graph_max_bs_decode": 1} if a.weight_graphs else {"disable_cuda_graph": True}))
        w = None
        try:
            w = start_engines([(label, {"KVGUARD_MODE": "off"}, kw)], min(a.int4_start_timeout, left() - 30))[label]
            r = w.run(n=1, input_len=a.single_input, output_len=a.single_output, seed=a.seed, vocab=vocab_of(mdir),
                      tag=f"single-{label}")
            r2 = w.run(n=1, input_len=a.single_input, output_len=a.single_output, seed=a.seed, vocab=vocab_of(mdir),
                       tag=f"single2-{label}")
            best = min((r, r2), key=lambda x: x["itl_p50"])
            weights[label] = {"engine": w.info, "decode_tok_s": 1.0 / best["itl_p50"], "itl_p50_ms": 1e3 * best["itl_p50"],
                              "runs": [slim(r), slim(r2)]}
            weights[label]["cuda_graphs"] = bool(a.weight_graphs)
            log(f"weights {label}: single-stream decode {1.0 / best['itl_p50']:.1f} tok/s (ITL p50 {1e3 * best['itl_p50']:.2f} ms, "
                f"CUDA graphs {'on' if a.weight_graphs else 'off'}); start {w.info['start_s']:.0f} s")
        except Exception as e:  # noqa: BLE001
            weights[label] = {"error": str(e)[-2000:]}
            log(f"weights {label}: failed: {str(e)[-500:]}")
        finally:
            if w is not None:
                w.stop(timeout=30)
        result["weights"] = weights
        save()
    result["total_s"] = time.perf_counter() - t0
    save()
