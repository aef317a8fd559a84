"""CPU cost of the kvguard tracker (torch reference path): recording, validating, and the no-op tracker.

Measures, with ``torch.set_num_threads(2)``, for 256 requests whose page-table rows cover 9,192 tokens
at page size 1 and 16:

- ``record_many`` of one decode step's new pages (page size 1: all 256 requests gain a page; page
  size 16: one request in 16 crosses a page boundary), and ``on_alloc`` of those pages;
- ``record`` of one whole 9,192-token prefill row;
- ``validate`` of all 256 rows plus ``resolve`` (reading the verdict), as an engine calls them (with its
  own untouched table passed as ``source``), and with the default ``source`` (the tracker snapshots the
  table before quarantining it);
- the ``NoopTracker``'s per-step ``validate`` + ``resolve`` calls.

Each figure is the median and p99 over ``--repeats`` (>= 30) timed runs after a warm-up. Prints a table
and writes the raw figures as JSON to ``--out`` (with the load average at start and end: on a loaded
machine, torch's multi-threaded gathers wait for busy cores and the figures inflate; compare
``--threads 1``).

    python bench/bench_tracker_cpu.py [--repeats 50] [--threads 2] [--out bench/results/cpu_tracker_cost.json]
"""
import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch
from prometheus_client import CollectorRegistry

from kvguard import TrackerConfig, make_tracker

REQUESTS = 256
TOKENS = 9_192
PAGE_SIZES = (1, 16)
THREADS = 2
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "cpu_tracker_cost.json"


def time_ns(fn, repeats: int, inner: int = 1, warmup: int = 3) -> list[float]:
    """``repeats`` samples of the wall time of ``fn()`` in ns (each sample averages ``inner`` calls)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        for _ in range(inner):
            fn()
        samples.append((time.perf_counter_ns() - start) / inner)
    return samples


def summarize(name: str, page_size: int | None, samples: list[float], **extra) -> dict:
    """Median, p99 and spread of a list of ns samples."""
    arr = np.asarray(samples)
    return {"name": name, "page_size": page_size, "n": len(samples), "median_ns": float(np.median(arr)),
            "p99_ns": float(np.percentile(arr, 99)), "min_ns": float(arr.min()),
            "mean_ns": float(arr.mean()), **extra}


class Setup:
    """A tracker attached to a pool sized for 256 full rows, every row recorded and healthy."""

    def __init__(self, page_size: int):
        self.page_size = page_size
        self.width = -(-TOKENS // page_size)  # pages per 9,192-token row
        spare = REQUESTS * 4
        self.num_pages = 1 + REQUESTS * self.width + spare
        self.tracker = make_tracker(TrackerConfig(mode="check", backend="torch"), CollectorRegistry())
        self.tracker.attach(num_pages=self.num_pages, num_rows=REQUESTS, max_entries=self.width,
                            device="cpu", page_size=page_size)
        pages = torch.arange(1, 1 + REQUESTS * self.width).view(REQUESTS, self.width)
        self.tracker.on_alloc(pages.flatten())
        for row in range(REQUESTS):
            self.tracker.record(row, 0, pages[row])
        self.table = pages.to(torch.int32).contiguous()  # batch-packed [256, width]
        self.source = self.table.clone()  # the engine's own (never quarantined) table
        self.rows = torch.arange(REQUESTS)
        self.n_entries = torch.full((REQUESTS,), self.width, dtype=torch.int32)
        self.request_ids = [f"req-{i}" for i in range(REQUESTS)]
        self.spare = torch.arange(1 + REQUESTS * self.width, self.num_pages)

    def decode_growth(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(rows, cols, pages) of one decode step: the requests that cross a page boundary."""
        gen = torch.Generator().manual_seed(self.page_size)
        count = REQUESTS if self.page_size == 1 else REQUESTS // self.page_size
        rows = torch.randperm(REQUESTS, generator=gen)[:count].sort().values
        cols = torch.randint(0, self.width, (count,), generator=gen)
        return rows, cols, self.spare[:count].clone()

    def step(self, source) -> int:
        """validate + resolve for all 256 rows; returns the number of violations (expected: 0)."""
        check = self.tracker.validate(self.table, self.rows, self.n_entries, max_entries=self.width,
                                      source=source)
        return len(self.tracker.resolve(check, check.verdict.cpu(), self.request_ids))


def bench_page_size(page_size: int, repeats: int) -> list[dict]:
    """All tracker figures for one page size."""
    s = Setup(page_size)
    rows, cols, new_pages = s.decode_growth()
    row_pages = torch.arange(1, 1 + s.width)
    assert s.step(s.source) == 0 and s.step(None) == 0, "setup must validate clean"
    entries = REQUESTS * s.width
    results = [
        summarize("record_many (decode step)", page_size,
                  time_ns(lambda: s.tracker.record_many(rows, cols, new_pages), repeats, inner=20),
                  pages=int(new_pages.numel())),
        summarize("on_alloc (decode step)", page_size,
                  time_ns(lambda: s.tracker.on_alloc(new_pages), repeats, inner=20),
                  pages=int(new_pages.numel())),
        summarize("record (9,192-token prefill row)", page_size,
                  time_ns(lambda: s.tracker.record(0, 0, row_pages), repeats, inner=5), pages=s.width),
    ]
    # the decode-step writes above changed row 0 / other cells: re-record every row so checks stay clean
    pages = torch.arange(1, 1 + REQUESTS * s.width).view(REQUESTS, s.width)
    s.tracker.on_alloc(pages.flatten())
    for row in range(REQUESTS):
        s.tracker.record(row, 0, pages[row])
    assert s.step(s.source) == 0
    for name, source in (("validate+resolve (source given)", s.source),
                         ("validate+resolve (default source)", None)):
        samples = time_ns(lambda: s.step(source), repeats)
        results.append(summarize(name, page_size, samples, entries=entries,
                                 ns_per_entry=float(np.median(samples)) / entries))
    return results


def bench_noop(repeats: int) -> dict:
    """The no-op tracker's per-step calls (what every deployment pays with kvguard off)."""
    tracker = make_tracker(TrackerConfig(mode="off"))
    table = torch.zeros((REQUESTS, 8), dtype=torch.int32)
    rows = torch.arange(REQUESTS)
    n_entries = torch.full((REQUESTS,), 8, dtype=torch.int32)
    ids = [f"req-{i}" for i in range(REQUESTS)]

    def step():
        check = tracker.validate(table, rows, n_entries, max_entries=8)
        tracker.resolve(check, None, ids)

    return summarize("NoopTracker validate+resolve", None, time_ns(step, repeats, inner=10_000))


def fmt_ns(ns: float) -> str:
    """ns with a readable unit."""
    for unit, scale in (("s", 1e9), ("ms", 1e6), ("us", 1e3)):
        if ns >= scale:
            return f"{ns / scale:.3g} {unit}"
    return f"{ns:.3g} ns"


def print_table(results: list[dict]) -> None:
    print(f"{'measurement':36} {'page':>5} {'median':>10} {'p99':>10} {'n':>4}  notes")
    for r in results:
        notes = ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                          for k, v in r.items() if k in ("pages", "entries", "ns_per_entry"))
        page = "-" if r["page_size"] is None else str(r["page_size"])
        print(f"{r['name']:36} {page:>5} {fmt_ns(r['median_ns']):>10} {fmt_ns(r['p99_ns']):>10} "
              f"{r['n']:>4}  {notes}")


def environment() -> dict:
    return {"torch": torch.__version__, "threads": torch.get_num_threads(), "python": sys.version.split()[0],
            "machine": platform.machine(), "processor": platform.processor(), "cpus": os.cpu_count(),
            "loadavg_at_start": list(os.getloadavg()), "requests": REQUESTS, "tokens_per_row": TOKENS,
            "backend": "torch", "unix_time": time.time()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=50, help="timed runs per figure (>= 30)")
    parser.add_argument("--threads", type=int, default=THREADS, help="torch.set_num_threads (default 2)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON output path")
    args = parser.parse_args(argv)
    if args.repeats < 30:
        parser.error("--repeats must be >= 30")
    torch.set_num_threads(args.threads)
    env = environment()
    results = [r for ps in PAGE_SIZES for r in bench_page_size(ps, args.repeats)]
    results.append(bench_noop(args.repeats))
    env["loadavg_at_end"] = list(os.getloadavg())
    print_table(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"environment": env, "results": results}, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
