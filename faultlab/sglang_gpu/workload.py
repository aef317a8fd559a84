"""The workload the harness streams through one engine, and its statistics.

``run_workload``: ``n`` requests submitted at once, streamed, greedy, ``ignore_eos``; per request the
time to first token, the inter-token gaps, the tokens and how it finished. ``summarize`` turns one run
into throughput and latency percentiles; ``compare`` turns interleaved off/check runs into ratios and the
A/A spread of the off runs.
"""
from __future__ import annotations

import math
import random
import time


def make_prompts(n: int, input_len: int, seed: int, vocab: int, shared_prefix: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(100, vocab - 100) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(100, vocab - 100) for _ in range(input_len - shared_prefix)]
            for _ in range(n)]


def run_workload(engine, *, n: int, input_len: int, output_len: int, seed: int, vocab: int,
                 tag: str = "r", shared_prefix: int = 0, keep_ids: bool = False, timeout: float = 600,
                 bootstrap: dict | None = None) -> dict:
    """Submit ``n`` requests at once and stream them; per request: TTFT, chunk gaps, tokens, finish.

    ``bootstrap`` (PD disaggregation): ``{"host", "port", "room"}``, the prefill server's bootstrap address;
    request ``i`` names room ``room + i``, and the prefill and the decode server are sent the same workload."""
    import asyncio

    prompts = make_prompts(n, input_len, seed, vocab, shared_prefix)
    params = {"max_new_tokens": output_len, "temperature": 0.0, "ignore_eos": True}

    async def one(i: int, t0: float) -> dict:
        rec = {"rid": f"{tag}-{i}", "gaps": [], "tokens": 0, "ttft": None, "finish": None, "error": None}
        last_t, last_n, ids = None, 0, []
        try:
            pd = {} if bootstrap is None else {"bootstrap_host": bootstrap["host"], "bootstrap_port": bootstrap["port"],
                                               "bootstrap_room": bootstrap["room"] + i}
            gen = await engine.async_generate(input_ids=prompts[i], sampling_params=params, stream=True,
                                              rid=rec["rid"], **pd)
            async for chunk in gen:
                now = time.perf_counter()
                meta = chunk.get("meta_info", {})
                ntok = int(meta.get("completion_tokens", last_n))
                out_ids = chunk.get("output_ids")
                if out_ids is not None:
                    ids = list(out_ids) if len(out_ids) >= ntok else ids + list(out_ids)
                if ntok > last_n:
                    if last_t is None:
                        rec["ttft"] = now - t0
                    else:
                        rec["gaps"].append((now - last_t) / (ntok - last_n))
                    last_t, last_n = now, ntok
                fin = meta.get("finish_reason")
                if fin is not None:
                    rec["finish"] = fin if isinstance(fin, dict) else {"type": str(fin)}
        except Exception as e:  # noqa: BLE001 - an error the client sees is a result here
            rec["error"] = f"{type(e).__name__}: {e}"
        rec["end"] = time.perf_counter() - t0
        rec["tokens"] = last_n
        if keep_ids:
            rec["output_ids"] = ids
        return rec

    async def main() -> list[dict]:
        t0 = time.perf_counter()
        return await asyncio.wait_for(asyncio.gather(*(one(i, t0) for i in range(n))), timeout)

    t_wall = time.perf_counter()
    recs = engine.loop.run_until_complete(main())
    wall = time.perf_counter() - t_wall
    return {"n": n, "input_len": input_len, "output_len": output_len, "seed": seed, "wall_s": wall,
            "requests": recs, **summarize(recs, wall)}


# ------------------------------------------------------------------------------------------------
# Statistics
# ------------------------------------------------------------------------------------------------
def pct(values, q: float) -> float:
    """Linear-interpolated percentile (q in 0..100); NaN for no values."""
    v = sorted(values)
    if not v:
        return math.nan
    k = (len(v) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def median(values) -> float:
    return pct(values, 50)


def summarize(recs: list[dict], wall: float) -> dict:
    gaps = [g for r in recs for g in r["gaps"]]
    ttfts = [r["ttft"] for r in recs if r["ttft"] is not None]
    tokens = sum(r["tokens"] for r in recs)
    return {"output_tokens": tokens, "throughput": tokens / wall if wall > 0 else math.nan,
            "itl_p50": pct(gaps, 50), "itl_p99": pct(gaps, 99), "itl_mean": sum(gaps) / len(gaps) if gaps else math.nan,
            "ttft_p50": pct(ttfts, 50), "ttft_p99": pct(ttfts, 99), "ttft_max": max(ttfts) if ttfts else math.nan,
            "errors": sum(1 for r in recs if r["error"] or (r["finish"] or {}).get("type") == "abort")}


METRICS = ("throughput", "itl_p50", "itl_p99", "ttft_p99")


def compare(runs: list[dict]) -> dict:
    """Ratios check/off of the per-run medians, and the A/A ratios of the off runs against each other.

    ``runs``: dicts with ``mode`` ('off' | 'check') and the summary metrics, in execution order. The A/A
    ratio splits the off runs into two interleaved halves (runs 1, 3, 5 ... against 0, 2, 4 ...) and
    divides their medians; ``aa_range`` is (max - min) / median over all off runs, per metric.
    """
    off = [r for r in runs if r["mode"] == "off"]
    chk = [r for r in runs if r["mode"] == "check"]
    out = {"n_off": len(off), "n_check": len(chk)}
    for m in METRICS:
        mo, mc = median([r[m] for r in off]), median([r[m] for r in chk])
        out[f"{m}_off"], out[f"{m}_check"] = mo, mc
        out[f"{m}_ratio"] = mc / mo if mo else math.nan
        a, b = [r[m] for r in off[0::2]], [r[m] for r in off[1::2]]
        out[f"aa_{m}_ratio"] = median(b) / median(a) if a and b and median(a) else math.nan
        vals = [r[m] for r in off]
        out[f"aa_{m}_range"] = (max(vals) - min(vals)) / mo if len(vals) > 1 and mo else math.nan
        cv = [r[m] for r in chk]
        out[f"check_{m}_range"] = (max(cv) - min(cv)) / mc if len(cv) > 1 and mc else math.nan
    return out
