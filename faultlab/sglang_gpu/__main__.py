"""``python -m faultlab.sglang_gpu``: the GPU harness for real SGLang (see :mod:`faultlab.sglang_gpu`)."""
import sys

from faultlab.sglang_gpu.cli import main

sys.exit(main())
