"""H200 benchmarks (see faultlab/gpubench.py): `python bench/h200.py --out bench/results`."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from faultlab.gpubench import main  # noqa: E402

if __name__ == "__main__":
    main()
