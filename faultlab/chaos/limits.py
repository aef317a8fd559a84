"""The bounds every number of a scenario, the CLI or the pytest plugin must respect (one table), and the
one check of a number that all of them use (choices: ``faultlab.engine.choices.check_choice``, the same
message shape).

A light module: the pytest plugin imports it at pytest start-up, so it imports nothing of faultlab's.
Each caller passes the error class it raises (ScenarioError, UsageError, pytest.UsageError, ValueError);
the message is the same everywhere: ``{where} = {value!r} is not valid / out of range; ...``.
"""
import math

SEED_MAX = 2**32 - 1  # seeds of runs, engines, faults and the pytest plugin: 0..SEED_MAX
MAX_TOKENS = 1 << 20  # any token count (prompt, output, context): far above every preset's context
COUNT_MAX = 1000  # strikes of one fault in one run (a scenario's [faults].count, a marker's count=)

# (section, field) -> (low, high), inclusive, for every number of a scenario (a range's two ends alike);
# the CLI's --seeds/--first-seed and a fault trigger's step and p read the same rows.
# NOTE: sizes that depend on the machine (pages, KV budget) are bounded again by validate.check_runnable.
LIMITS = {
    ("workload", "requests"): (1, 10_000), ("workload", "prompt_len"): (1, MAX_TOKENS),
    ("workload", "output_len"): (1, MAX_TOKENS), ("workload", "concurrency"): (1, 1024),
    ("workload", "shared_prefix_fraction"): (0.0, 1.0), ("workload", "shared_prefix_len"): (0, MAX_TOKENS),
    ("workload", "arrivals_per_step"): (1, 10_000), ("workload", "temperature"): (0.0, 100.0),
    ("faults", "seeds"): (1, 1_000_000), ("faults", "first_seed"): (0, SEED_MAX), ("faults", "count"): (1, COUNT_MAX),
    ("faults", "step"): (0, 1_000_000), ("faults", "p"): (0.0, 1.0),
    ("expect", "max_false_positives"): (0, 10**9), ("expect", "max_corrupted_tokens_with_tracker"): (0, 10**9),
    ("engine", "kv_residual_sink"): (0, MAX_TOKENS), ("engine", "kv_residual_window"): (1, MAX_TOKENS),
    ("engine", "kv_budget_mb"): (2**-10, 2**30), ("engine", "num_pages"): (0, 2**31 - 1),
    ("engine", "max_running"): (1, 1024), ("engine", "max_context"): (2, MAX_TOKENS),
    ("engine", "seed"): (0, SEED_MAX), ("engine", "transfer_lag"): (1, 1000),
}


def check_number(where: str, value, low, high, error: type[Exception] = ValueError):
    """``value`` if it is a number (an int where ``low`` is an int) in [low, high]; else ``error``."""
    kind = "an integer" if isinstance(low, int) else "a number"
    if isinstance(value, bool) or not isinstance(value, int if isinstance(low, int) else (int, float)):
        raise error(f"{where} = {value!r} is not valid; it must be {kind} in {low}..{high}")
    if (isinstance(value, float) and not math.isfinite(value)) or not low <= value <= high:
        raise error(f"{where} = {value!r} is out of range; it must be {kind} in {low}..{high}")
    return value
