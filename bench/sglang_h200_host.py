"""kvguard's host time per decode iteration on the H200, with the overlap scheduler on and off.

    python bench/sglang_h200_host.py [RAW_OVERHEAD_JSON ...] [--out bench/results/sglang_h200_host.json]

Reads raw ``python3 -m faultlab.sglang_gpu overhead`` results (default: the December 1 runs after the
host-path work, bench/results/sglang_h200_raw/dec01d and dec01e) and writes one row per (overlap,
concurrency) in the issue's format, each raw file's command kept beside its rows.
"""
import argparse
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
RAW = os.path.join(HERE, "results", "sglang_h200_raw")
DEFAULT = [os.path.join(RAW, "dec01d", "overhead_nooverlap.json"), os.path.join(RAW, "dec01e", "overhead_overlap_1024.json")]
KEYS = ("overlap", "concurrency", "page_size", "input_len", "output_len", "throughput_ratio", "itl_p50_ratio",
        "itl_p99_ratio", "aa_throughput_ratio", "aa_itl_p50_ratio", "host_us_p50", "host_us_p99", "tp")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("raw", nargs="*", default=DEFAULT)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "sglang_h200_host.json"))
    a = ap.parse_args()
    rows, commands = [], []
    for path in a.raw:
        with open(path) as f:
            raw = json.load(f)
        commands.append(raw["command"])
        for row in raw["rows"]:
            rows.append({k: row.get(k) for k in KEYS} | {"pairs": row.get("pairs"), "raw": os.path.relpath(path, HERE),
                                                         "sglang": raw["environment"].get("sglang")})
    out = {"command": " && ".join(commands), "sglang": rows[0]["sglang"] if rows else None, "rows": rows}
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    print("overlap | c | in/out | host us p50 / p99 | throughput | ITL p50 | ITL p99 (ratios check/off)")
    for r in rows:
        print(f"{r['overlap']!s:>7} | {r['concurrency']:>3} | {r['input_len']}/{r['output_len']} | "
              f"{r['host_us_p50']:.0f} / {r['host_us_p99']:.0f} | {r['throughput_ratio']:.4f} | "
              f"{r['itl_p50_ratio']:.4f} | {r['itl_p99_ratio']:.4f}")


if __name__ == "__main__":
    main()
