"""Phase split on the real model (SmolLM2-135M): accuracy against the single pool, and the guard's CPU cost.

    python bench/phase_split.py [--max-tokens 16] [--out bench/results/phase_split_smollm2.json]
    python bench/phase_split.py --guard-only

1. Greedy text of the demo prompts (faultlab/chaos/demo.py PROMPTS), engine as the demo's (INT4 weights,
   page size 16, prefix cache, batch-invariant): single pool (FP8 KV) vs phase split (BF16 prefill pool
   -> FP8 decode pool, lag 1). Reports whether each text is identical, and the teacher-forced top-1
   agreement: the phase-split engine is fed the single-pool tokens and its argmax is compared at every
   generated position (free-running texts stop being comparable after their first difference).
2. The transfer guard's cost per transfer on CPU (one torch thread): ``transfer_issue`` (tag snapshot)
   + ``transfer_land`` (batched compare) + reading the verdict, for transfers of 1, 4 and 16 pages;
   median and p99 over ``--transfers`` transfers, the no-op tracker alongside.
"""
import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from faultlab.chaos.runner import checking_tracker
from faultlab.chaos.demo import ENGINE, PROMPTS
from faultlab.engine.factory import make_engine
from faultlab.engine.requests import Request

SPLIT = replace(ENGINE, phase_split=True, prefill_kv_dtype="bf16", transfer_lag=1)


def generate(config, max_tokens: int, forced: dict | None = None):
    """(texts' token ids per prompt, argmax per step when ``forced`` feeds the tokens)."""
    engine = make_engine(config)
    tok = engine.tokenizer
    argmax: dict[str, list[int]] = {}
    if forced is not None:
        def sample(request, logits):
            argmax.setdefault(request.rid, []).append(int(torch.argmax(logits)))
            return forced[request.rid][len(request.output)]

        engine._sample = sample
    requests = [Request(f"p{i}", tok.encode(p), max_tokens, stop_ids=(tok.eos_id,)) for i, p in enumerate(PROMPTS)]
    for r in requests:
        engine.add_request(r)
    engine.run()
    return {r.rid: list(r.output) for r in requests}, argmax, tok


def accuracy(max_tokens: int) -> dict:
    started = time.time()
    single, _, tok = generate(ENGINE, max_tokens)
    split, _, _ = generate(SPLIT, max_tokens)
    _, argmax, _ = generate(SPLIT, max_tokens, forced=single)
    pairs = [(a, b) for rid in single for a, b in zip(argmax[rid], single[rid])]
    rows = []
    for i, prompt in enumerate(PROMPTS):
        rid = f"p{i}"
        rows.append({"prompt": prompt, "single": tok.decode(single[rid]), "split": tok.decode(split[rid]),
                     "identical": single[rid] == split[rid]})
        mark = "same" if rows[-1]["identical"] else "DIFF"
        print(f"[{mark}] {prompt!r}\n   single: {rows[-1]['single']!r}\n   split:  {rows[-1]['split']!r}")
    agreement = sum(a == b for a, b in pairs) / len(pairs)
    print(f"identical texts: {sum(r['identical'] for r in rows)}/{len(rows)}; teacher-forced top-1 agreement "
          f"{agreement:.4f} over {len(pairs)} positions ({time.time() - started:.0f} s)")
    return {"texts": rows, "identical": sum(r["identical"] for r in rows), "prompts": len(rows),
            "top1_agreement": agreement, "positions": len(pairs)}


def _time_transfers(tracker, n_pages: int, transfers: int, num_pages: int) -> list[float]:
    gen = torch.Generator().manual_seed(n_pages)
    times = []
    for i in range(transfers + 50):
        pages = torch.randperm(num_pages, generator=gen)[:n_pages] + 1
        t0 = time.perf_counter()
        ticket = tracker.transfer_issue(pages)
        ok = tracker.transfer_land([ticket])
        if ok is not None:
            ok.cpu()
        if i >= 50:  # warm-up
            times.append(time.perf_counter() - t0)
    return times


def guard_cost(transfers: int, num_pages: int = 4096) -> dict:
    torch.set_num_threads(1)
    tag = checking_tracker()
    tag.attach(num_pages=num_pages + 1, num_rows=8, max_entries=64, device="cpu", page_size=16)
    noop = checking_tracker(on=False)
    out = {}
    for n_pages in (1, 4, 16):
        for name, tracker in (("tag", tag), ("noop", noop)):
            times = sorted(_time_transfers(tracker, n_pages, transfers, num_pages))
            median, p99 = statistics.median(times) * 1e6, times[int(0.99 * len(times))] * 1e6
            out[f"{name}_{n_pages}_pages"] = {"median_us": round(median, 2), "p99_us": round(p99, 2)}
            print(f"guard {name:>4}, {n_pages:>2} pages/transfer: median {median:7.2f} us  p99 {p99:7.2f} us "
                  f"({transfers} transfers)")
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--transfers", type=int, default=5000)
    parser.add_argument("--guard-only", action="store_true")
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args(argv)
    result = {"engine_single": asdict(ENGINE), "engine_split": asdict(SPLIT),
              "guard_cpu": guard_cost(args.transfers)}
    if not args.guard_only:
        result["accuracy"] = accuracy(args.max_tokens)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
