"""specdec's benchmarks: the harness (``bench.harness``, ``bench.report``) and the ``bench_*.py`` scripts.

Run a script from the repository root as ``python bench/bench_x.py`` or ``python -m bench.bench_x``. Not shipped in
the wheel: the benchmarks need a source checkout.
"""
