"""Test-wide settings: Triton runs under its interpreter on CPU; torch uses one thread.

NOTE: the CI machine has 2 cores and pytest runs tiny models; torch's default thread pool spends more
time synchronizing than computing on such shapes (measured ~10x slower under load).
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

torch.set_num_threads(1)
