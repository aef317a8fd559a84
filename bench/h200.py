"""H200 benchmarks (see faultlab/gpu/bench.py): `python bench/h200.py --out bench/results`."""
from faultlab.gpu.bench import main

if __name__ == "__main__":
    main()
