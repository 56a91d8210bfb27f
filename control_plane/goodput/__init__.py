"""Goodput: pure rules (watchdogs, the checkpoint interval), the accounting of a job's GPU-time, and
the discrete-event model behind ``trainyard simulate``. Standard library only (the pure import
contract in pyproject.toml); services/runs/watchdog.py, runs/intervals.py and read/goodput.py feed them rows."""
