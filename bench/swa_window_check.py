"""The SWA window check (kvguard/kernels/window_check.py) on a GPU: compiled kernel == torch reference, and its cost.

    python bench/swa_window_check.py OUT.json

1. Correctness: the compiled Triton kernel against ``window_check_ref`` on seeded random SWA pools (page 1 and 16,
   odd batch sizes, corruptions inside and outside the windows), exact equality of the verdict, flag and guard.
2. Cost per forward of a decode step (one launch, what kvguard adds per forward on an SWA pool): host time of the
   call (direct launch, after a warm-up) and GPU time (CUDA events), batch 1 / 64 / 256, window 128 and 4096.
Needs only torch and triton (imports kvguard.kernels alone).
"""
from __future__ import annotations

import json
import statistics
import sys
import time

import torch

from kvguard.kernels.tag_check import WriteGuard
from kvguard.kernels.window_check import WindowCheck, window_check_ref


def pools(seed: int, batch: int, width: int, ps: int, dev: str):
    gen = torch.Generator().manual_seed(seed)
    full_slots, swa_slots = 4096 * ps, 3072 * ps
    pair = torch.full((full_slots,), -1, dtype=torch.int64)
    paired = torch.randperm(full_slots - ps, generator=gen)[: swa_slots - ps] + ps
    pair[paired] = torch.randperm(swa_slots - ps, generator=gen)[: paired.numel()] + ps
    tags = torch.randperm(7 * swa_slots, generator=gen)[: swa_slots // ps].long() + 1_000_003
    index_map = torch.zeros(full_slots + ps + 1, dtype=torch.int64)
    index_map[:full_slots] = pair.clamp(min=0)
    index_map[-1] = -1
    pair_tag = torch.where(pair > 0, tags[pair.clamp(min=0) // ps], torch.full_like(pair, -1))
    table = torch.stack([paired[torch.randperm(paired.numel(), generator=gen)[:width]] for _ in range(batch + 2)])
    rows = torch.randperm(batch + 2, generator=gen)[:batch]
    n = torch.randint(1, width + 1, (batch,), generator=gen)
    for _ in range(batch // 2):  # corruptions anywhere in the live rows
        b = int(torch.randint(0, batch, (1,), generator=gen))
        j = int(torch.randint(0, int(n[b]), (1,), generator=gen))
        full = int(table[int(rows[b]), j])
        kind = int(torch.randint(0, 3, (1,), generator=gen))
        if kind == 0:
            index_map[full] = 0
        elif kind == 1:
            index_map[full] = int(pair[int(paired[0])])
        else:
            tags[int(pair[full]) // ps] += 1
    to = dict(device=dev)
    return (table.to(torch.int32).to(**to), index_map.to(**to), pair.to(**to), pair_tag.to(**to), tags.to(**to),
            rows.to(**to), n.to(**to), swa_slots)


def correctness(dev: str) -> dict:
    cases = mismatches = flagged = 0
    for seed in range(40):
        ps = (1, 16)[seed % 2]
        batch, width, window = (1, 3, 7, 33, 64)[seed % 5], (17, 130, 700)[seed % 3], (0, 15, 127)[seed % 3]
        table, imap, pair, ptag, tags, rows, n, swa = pools(seed, batch, width, ps, dev)
        q = None if seed % 4 else torch.randint(1, 9, (batch,), device=dev)
        results = []
        for ref in (False, True):
            verdict = torch.zeros((batch, 2), dtype=torch.int32, device=dev)
            flag = torch.zeros(1, dtype=torch.int64, device=dev)
            guard = WriteGuard(torch.arange(100, 100 + batch, device=dev), scratch=0)
            if ref:
                window_check_ref(table, imap, pair, ptag, tags, rows, n, verdict, page_div=ps, window=window,
                                 swa_limit=swa, q=q, guard=guard, flag=flag, stamp=5)
            else:
                WindowCheck(table, imap, pair, ptag, tags, page_div=ps, window=window, swa_limit=swa)(
                    rows, n, verdict, q=q, guard=guard, flag=flag, stamp=5)
            torch.cuda.synchronize()
            results.append((verdict.cpu(), flag.cpu(), guard.slots.cpu()))
        cases += 1
        same = all(torch.equal(a, b) for a, b in zip(*results))
        mismatches += not same
        flagged += int((results[0][0][:, 0] > 0).sum())
    return {"cases": cases, "mismatches": mismatches, "requests_flagged": flagged}


def cost(dev: str) -> list[dict]:
    out = []
    for batch in (1, 64, 256):
        for window in (128, 4096):
            ps = 16
            width = window + 512
            table, imap, pair, ptag, tags, rows, n, swa = pools(7, batch, width, ps, dev)
            n = torch.full((batch,), width, device=dev)
            check = WindowCheck(table, imap, pair, ptag, tags, page_div=ps, window=window, swa_limit=swa)
            t0 = time.perf_counter()
            check.warm_up()  # what a server's warm-up compiles (every variant it launches)
            warm_s = time.perf_counter() - t0
            launches = check.kernel.direct_launches
            verdict = torch.zeros((batch, 1), dtype=torch.int32, device=dev)
            flag = torch.zeros(1, dtype=torch.int64, pin_memory=True)
            guard = WriteGuard(torch.arange(100, 100 + batch, device=dev), scratch=0)
            for _ in range(20):
                check(rows, n, verdict, guard=guard, flag=flag, stamp=1)
            torch.cuda.synchronize()
            host = []
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(1000):
                t = time.perf_counter()
                check(rows, n, verdict, guard=guard, flag=flag, stamp=1)
                host.append(time.perf_counter() - t)
            end.record()
            torch.cuda.synchronize()
            out.append({"batch": batch, "window": window, "page_size": ps,
                        "host_us_median": round(statistics.median(host) * 1e6, 2),
                        "host_us_p90": round(sorted(host)[900] * 1e6, 2),
                        "gpu_us_per_call": round(start.elapsed_time(end) * 1e3 / 1000, 2),
                        "warm_up_s": round(warm_s, 2), "variants": len(check._raw),
                        "direct_after_warm_up": check.kernel.direct_launches - launches})
    return out


def main(path: str) -> None:
    dev = "cuda"
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "correctness": correctness(dev), "cost": cost(dev)}
    print(json.dumps(result, indent=1))
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
