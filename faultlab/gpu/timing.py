"""CUDA-event timing for faultlab's GPU benchmarks (``faultlab bench``, bench/layout_cost.py, bench/tp_bench.py):
percentiles, timed calls, CUDA-graph capture and interleaved replays, the copy bandwidth (the roofline's ceiling).
"""
import statistics

import torch


def pct(values, q):
    """The q-th percentile of ``values`` (nearest rank)."""
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def copy_bandwidth(dev) -> float:
    """Device-to-device copy, GB/s of bytes read + written (the roofline's ceiling)."""
    n = 2 << 30
    x = torch.empty(n, dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    times = timed(lambda: y.copy_(x), reps=20)
    del x, y
    return 2 * n / statistics.median(times) / 1e9


def timed(fn, reps=20, warmup=3) -> list[float]:
    """Seconds per call, CUDA events around each call."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    marks = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        marks.append((a, b))
    torch.cuda.synchronize()
    return [a.elapsed_time(b) / 1e3 for a, b in marks]


def capture(fn):
    """A CUDA graph of fn (warmed up on a side stream first)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def interleaved(graphs: dict, pairs: int) -> dict:
    """Replay graphs in rotating order; seconds per replay, per graph."""
    names = list(graphs)
    marks = {n: [] for n in names}
    for g in graphs.values():
        g.replay()
    torch.cuda.synchronize()
    for i in range(pairs):
        order = names[i % len(names):] + names[:i % len(names)]
        for n in order:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graphs[n].replay()
            b.record()
            marks[n].append((a, b))
    torch.cuda.synchronize()
    return {n: [a.elapsed_time(b) / 1e3 for a, b in m] for n, m in marks.items()}
