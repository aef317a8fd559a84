"""The chaos runner, its inputs (scenarios, limits, checks) and the ``faultlab`` commands."""
