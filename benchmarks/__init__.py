"""The pieces bench.py uses, one idea a module; bench.py reads them in this order.
(In full: docs/07_benchmarks.md, "The benchmark modules in full".)
"""
