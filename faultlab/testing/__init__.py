"""The pytest side: the opt-in plugin (``faultlab.testing.pytest_plugin``), its marker, Hypothesis strategies."""
