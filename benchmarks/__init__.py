"""The pieces bench.py uses, one idea a module; bench.py reads them in this order. What each measures
and why, in full: docs/07_benchmarks.md, "The benchmark modules in full"."""
