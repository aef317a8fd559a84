"""H200 benchmarks (see faultlab/gpubench.py): `python bench/h200.py --out bench/results`."""
from faultlab.gpubench import main

if __name__ == "__main__":
    main()
