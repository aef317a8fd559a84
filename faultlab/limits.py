"""Bounds shared by scenarios, the CLI and the pytest plugin (a light module: the plugin imports it at
pytest start-up, so it imports nothing)."""

SEED_MAX = 2**32 - 1  # seeds of runs, engines, faults and the pytest plugin: 0..SEED_MAX
MAX_TOKENS = 1 << 20  # any token count (prompt, output, context): far above every preset's context
COUNT_MAX = 1000  # strikes of one fault in one run (a scenario's [faults].count, a marker's count=)
