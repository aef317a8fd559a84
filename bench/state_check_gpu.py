"""The recurrent-state slot check on a GPU: the kernel against its torch reference, and what one launch costs.

    python bench/state_check_gpu.py [OUT.json]

Checks ``kvguard.kernels.state_check.StateCheck`` (JIT launch, then direct launches) against ``state_check_ref``
on seeded random tables with corruptions of each kind, for batch sizes 1..512; then times, per batch size, the
host time of one launch (the scheduler thread's cost) and the device time of 1,000 launches (CUDA events).
"""
from __future__ import annotations

import json
import sys
import time

import torch

from kvguard.kernels.state_check import StateCheck, state_check_ref


def case(seed: int, batch: int, device):
    g = torch.Generator().manual_seed(seed)
    n_slots, n_rows = 2 * batch + 9, 2 * batch + 5
    slots = torch.randperm(n_slots - 1, generator=g)[:batch] + 1
    rows = torch.randperm(n_rows - 1, generator=g)[:batch] + 1
    table = torch.zeros(n_rows, dtype=torch.int32)
    table[rows] = slots.int()
    gens = torch.randint(1, 9, (n_slots,), generator=g)
    exp_gen = gens[slots].clone()
    exp_slot = slots.clone()
    bad = torch.rand(batch, generator=g) < 0.2
    for b in bad.nonzero().flatten().tolist():
        kind = b % 3
        if kind == 0:
            table[rows[b]] = int(slots[(b + 1) % batch]) if batch > 1 else int(slots[b]) + 1
        elif kind == 1:
            gens[slots[b]] += 1
        else:
            exp_slot[b] = -1
    to = dict(device=device)
    return table.to(**to), rows.to(**to), exp_slot.to(**to), exp_gen.to(**to), gens.to(**to)


def main(out: str | None = None) -> int:
    device = torch.device("cuda")
    result = {"device": torch.cuda.get_device_name(), "checked": 0, "timing": []}
    for batch in (1, 2, 7, 64, 129, 512):
        for seed in range(5):
            table, rows, exp_slot, exp_gen, gens = case(seed, batch, device)
            ref_table = table.clone()
            want = state_check_ref(ref_table, rows, exp_slot, exp_gen, gens)
            check = StateCheck(table, gens)
            out_buf = torch.full((batch + 3,), -7, dtype=torch.int32, device=device)
            for _ in range(3):  # the JIT launch, then direct ones (the table is already redirected: same verdict)
                got = check(rows, exp_slot, exp_gen, out_buf)
                assert torch.equal(got, want), (batch, seed, got.tolist(), want.tolist())
                assert torch.equal(table, ref_table), (batch, seed)
                assert out_buf[batch:].tolist() == [-7] * 3
            result["checked"] += 1
        table, rows, exp_slot, exp_gen, gens = case(0, batch, device)
        exp_slot = table[rows].long()  # a clean batch (nothing redirected between launches)
        exp_gen = gens[exp_slot]
        check = StateCheck(table, gens)
        out_buf = torch.zeros(batch, dtype=torch.int32, device=device)
        for _ in range(50):
            check(rows, exp_slot, exp_gen, out_buf)
        torch.cuda.synchronize()
        n = 2000
        t0 = time.perf_counter()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            check(rows, exp_slot, exp_gen, out_buf)
        end.record()
        host_us = (time.perf_counter() - t0) / n * 1e6
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        for _ in range(n):  # the floor: one torch op's launch from Python
            out_buf.add_(0)
        torch_us = (time.perf_counter() - t1) / n * 1e6
        torch.cuda.synchronize()
        result["timing"].append({"batch": batch, "host_us_per_launch": round(host_us, 2),
                                 "device_us_per_launch": round(start.elapsed_time(end) / n * 1e3, 2),
                                 "torch_add_host_us": round(torch_us, 2),
                                 "direct_launches": check.launch.direct_launches})
    print(json.dumps(result, indent=1))
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
