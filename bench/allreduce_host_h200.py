"""Host time of the pieces of kvguard's attention-TP step on one GPU: a MAX all-reduce of a small int32 verdict
over one rank, through kvguard's own NCCL communicator (kvguard.sglang.agree.VerdictAgreement: SGLang's NCCL
bindings, one ctypes call) and, for comparison, through torch.distributed's NCCL process group; the device copy
before it and the pinned host copy after it. Prints p50/p99 microseconds per call (host time: no synchronize
inside). Needs SGLang on the path (bench/sglang_h200_setup.sh).

    python3 bench/allreduce_host_h200.py [--calls 2000] [--cells 576]
"""
import argparse
import os
import time

import torch
import torch.distributed as dist


def timed(fn, calls: int) -> tuple[float, float]:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
        if len(out) % 64 == 0:
            torch.cuda.synchronize()  # (outside the timed call) keep the queue short, as one step a forward does
    out.sort()
    return 1e6 * out[len(out) // 2], 1e6 * out[int(len(out) * 0.99)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--cells", type=int, default=576)  # 64 requests x 9 chunks (8192 + 1000 entries)
    a = ap.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda:0"))
    group = dist.new_group([0], backend="nccl")
    gloo = dist.new_group([0], backend="gloo")
    src = torch.randint(0, 3, (a.cells,), dtype=torch.int32, device="cuda")
    dev = torch.empty_like(src)
    host = torch.empty(a.cells, dtype=torch.int32, pin_memory=True)
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MAX

    def direct():  # the process group's own allreduce, without torch.distributed's Python wrapper
        group.allreduce([dev], opts).wait()

    from kvguard.sglang.agree import VerdictAgreement

    agreement = VerdictAgreement(gloo, torch.device("cuda", 0))
    dev.copy_(src)
    agreement.max_(dev)
    torch.cuda.synchronize()
    assert torch.equal(dev, src), "one rank's MAX all-reduce changed the tensor"
    rows = {
        "copy_ (device)": lambda: dev.copy_(src),
        "VerdictAgreement.max_ (kvguard's NCCL comm)": lambda: agreement.max_(dev),
        "all_reduce MAX (nccl, 1 rank, group)": lambda: dist.all_reduce(dev, op=dist.ReduceOp.MAX, group=group),
        "all_reduce MAX (nccl, 1 rank, world)": lambda: dist.all_reduce(dev, op=dist.ReduceOp.MAX),
        "ProcessGroup.allreduce + wait (nccl, direct)": direct,
        "copy_ to pinned host, non_blocking": lambda: host.copy_(dev, non_blocking=True),
        "all_reduce MAX (gloo on a host tensor)": lambda: dist.all_reduce(host, op=dist.ReduceOp.MAX, group=gloo),
    }
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, {a.cells} int32 cells, {a.calls} calls")
    for name, fn in rows.items():
        p50, p99 = timed(fn, a.calls)
        print(f"{name:42s} p50 {p50:8.1f} us  p99 {p99:8.1f} us")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
