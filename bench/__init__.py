"""One script per figure the project measures (docs/benchmarks.md); run each as ``python bench/NAME.py``."""
