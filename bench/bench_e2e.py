"""End-to-end benchmark: the engine in every speculation mode against HF transformers (see spec_engine/benchmark.py).

    python bench/bench_e2e.py [--quick] [--model DIR --draft DIR] [--max-tokens N] [--threads N] [--out DIR]

The same as ``specdec bench``; writes bench/out/e2e.json and PNG plots.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spec_engine.benchmark import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
