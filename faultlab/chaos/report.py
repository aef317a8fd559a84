"""Reports a person can read: aggregate cases per (fault, tracker), a terminal table, JSON, a PNG."""
import json
import os
import statistics
import tempfile
from collections import defaultdict
from pathlib import Path

from faultlab.faults.catalog import FAULTS

COLUMNS = ("fault", "detectable", "tracker", "injected", "victims", "victims_aborted", "false_positives",
           "corrupted_tokens_returned", "median_detection_latency_steps")


def aggregate(cases) -> list[dict]:
    """One row per (fault, tracker), in catalog order, with the report's fields."""
    groups = defaultdict(list)
    for case in cases:
        groups[(case.fault or "none", case.tracker)].append(case)
    order = {name: i for i, name in enumerate(["none", *FAULTS])}
    rows = []
    for (fault, tracker), group in sorted(groups.items(), key=lambda kv: (order.get(kv[0][0], 99), kv[0][1])):
        latencies = [x for c in group for x in c.detection_latencies]
        sg = defaultdict(int)
        for c in group:
            for name, step in c.sglang_checks.items():
                sg[name] += step is not None
        rows.append({
            "fault": fault,
            "detectable": FAULTS[fault].detectable if fault in FAULTS else None,
            "tracker": tracker,
            "cases": len(group),
            "injected": sum(c.injected for c in group),
            "victims": sum(c.victims for c in group),
            "victims_aborted": sum(c.victims_aborted for c in group),
            "false_positives": sum(c.false_positives for c in group),
            "corrupted_tokens_returned": sum(c.corrupted_tokens_returned for c in group),
            "median_detection_latency_steps": statistics.median(latencies) if latencies else None,
            "nonvictim_mismatches": sum(c.nonvictim_mismatches for c in group),
            "sglang_style_checks_fired": dict(sg),
        })
    return rows


def failures(row: dict, expect=None) -> list[str]:
    """Why one aggregated row fails the scenario's ``[expect]`` (an ``Expectations``; None: the defaults).

    Every row: a fault that never struck in any of its cases fails (the run tested nothing). Tracker-on
    rows: non-victims' outputs must equal the fault-free run and at most ``max_false_positives`` false
    aborts; a detectable class returns at most ``max_corrupted_tokens_with_tracker`` corrupted tokens
    and, with ``all_detectable_caught``, has victims, all of them aborted (an undetectable class
    corrupts by design: the catalog says why).
    """
    from faultlab.chaos.scenario import Expectations

    expect = expect or Expectations()
    why = []
    if row["fault"] != "none" and row["injected"] == 0:
        why.append(f"{row['fault']} never struck in {row['cases']} case(s) (tracker {row['tracker']})")
    if row["tracker"] != "on":
        return why
    if row["nonvictim_mismatches"]:
        why.append(f"{row['nonvictim_mismatches']} non-victim output(s) differ from the fault-free run")
    if row["false_positives"] > expect.max_false_positives:
        why.append(f"{row['false_positives']} false positive(s) > [expect].max_false_positives = "
                   f"{expect.max_false_positives}")
    if row["detectable"] and row["corrupted_tokens_returned"] > expect.max_corrupted_tokens_with_tracker:
        why.append(f"{row['corrupted_tokens_returned']} corrupted token(s) returned > "
                   f"[expect].max_corrupted_tokens_with_tracker = {expect.max_corrupted_tokens_with_tracker}")
    if row["detectable"] and expect.all_detectable_caught and row["injected"]:
        if row["victims"] == 0:
            why.append(f"{row['fault']} struck but harmed no request: nothing to catch "
                       f"([expect].all_detectable_caught)")
        elif row["victims_aborted"] < row["victims"]:
            why.append(f"{row['victims'] - row['victims_aborted']} of {row['victims']} victims not aborted "
                       f"([expect].all_detectable_caught)")
    return why


def verdict(row: dict, expect=None) -> str:
    """PASS/FAIL/info for one aggregated row (see :func:`failures`); tracker-off rows that struck are info."""
    if failures(row, expect):
        return "FAIL"
    return "info" if row["tracker"] == "off" else "PASS"


def table(rows: list[dict], expect=None) -> str:
    heads = ["fault", "det", "tracker", "inj", "victims", "aborted", "false+", "corrupt tok", "lat", "mism",
             "sglang-style", "verdict"]
    lines = []
    for r in rows:
        sg = ",".join(f"{k.split('_')[0]}:{v}" for k, v in r["sglang_style_checks_fired"].items() if v) or "-"
        lat = r["median_detection_latency_steps"]
        lines.append([r["fault"], {True: "yes", False: "no", None: "-"}[r["detectable"]], r["tracker"],
                      r["injected"], r["victims"], r["victims_aborted"], r["false_positives"],
                      r["corrupted_tokens_returned"], "-" if lat is None else f"{lat:g}",
                      r["nonvictim_mismatches"], sg, verdict(r, expect)])
    widths = [max(len(str(x)) for x in col) for col in zip(heads, *lines)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [fmt.format(*heads), fmt.format(*["-" * w for w in widths])]
    out += [fmt.format(*map(str, line)) for line in lines]
    return "\n".join(out)


def write_json(path: str | Path, payload: dict) -> None:
    """Write atomically: a reader never sees a half-written report, and a failure leaves no temp file."""
    _atomic(path, lambda tmp: Path(tmp).write_text(json.dumps(payload, indent=2, default=str)))


def _atomic(path: str | Path, write) -> None:
    """``write(tmp)`` into a temp file beside ``path``, then rename it over ``path``; remove it on error."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=path.suffix)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def plot(rows: list[dict], path: str | Path, title: str) -> None:
    """Bars per fault class: victims, victims aborted and corrupted tokens, tracker off vs on."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    faults = [r["fault"] for r in rows if r["tracker"] == "on"]
    by = {(r["fault"], r["tracker"]): r for r in rows}
    fig, axes = plt.subplots(1, 2, figsize=(14, 5), sharey=False)
    for ax, tracker in zip(axes, ("off", "on")):
        xs = range(len(faults))
        get = lambda f, k: by.get((f, tracker), {}).get(k, 0) or 0  # noqa: E731
        ax.bar([x - 0.27 for x in xs], [get(f, "victims") for f in faults], 0.27, label="victims")
        ax.bar(list(xs), [get(f, "victims_aborted") for f in faults], 0.27, label="victims aborted")
        ax.bar([x + 0.27 for x in xs], [get(f, "corrupted_tokens_returned") for f in faults], 0.27,
               label="corrupted tokens returned")
        ax.set_xticks(list(xs), faults, rotation=60, ha="right", fontsize=8)
        ax.set_title(f"tracker {tracker}")
        ax.set_yscale("symlog")
    axes[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    try:
        _atomic(path, lambda tmp: fig.savefig(tmp, dpi=110))
    finally:
        plt.close(fig)
