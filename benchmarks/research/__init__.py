"""Research tools: what one run of bench.py cannot say, measured on its own (docs/07_benchmarks.md,
"The benchmark modules in full")."""
