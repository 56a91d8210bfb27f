"""Trainyard node agent: runs the control plane's attempts on one node (see agent.py)."""
