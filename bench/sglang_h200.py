"""kvguard in a real SGLang 0.5.23 server on the H200: a thin front for ``python -m faultlab.sglang_gpu``.

The harness is the package :mod:`faultlab.sglang_gpu`; this script only runs its ``main``. On the GPU
machine, from the project tree (see bench/sglang_h200_snapshot.sh), after
``source bench/sglang_h200_setup.sh`` (the offline SGLang bundle, and the plugin entry points' folder
/tmp/kvguard_bench_ep on PYTHONPATH):

    python3 -m faultlab.sglang_gpu overhead --out $OUT    # kvguard check vs off vs off (A/A), c = 1, 8, 64
    python3 -m faultlab.sglang_gpu extras --out $OUT      # FP8 vs BF16 KV, first requests, INT4 vs BF16 weights
    python3 -m faultlab.sglang_gpu faults --out $OUT      # live faults (faultlab.sglang_live), kvguard on/off
    python3 -m faultlab.sglang_gpu report                 # here: raw JSONs -> bench/results/sglang_h200*.json + png

``python3 bench/sglang_h200.py ...`` takes the same arguments (the project root must be importable: it is
on PYTHONPATH after the setup script, or the project is installed). Every phase dry-runs on a CPU with
``--cpu`` (tiny Llama, torch_native attention, short lengths).
"""
import sys

from faultlab.sglang_gpu.cli import main

if __name__ == "__main__":
    sys.exit(main())
