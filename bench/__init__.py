"""One script per figure the project promises (docs/operations.md); run each as ``python bench/NAME.py``."""
