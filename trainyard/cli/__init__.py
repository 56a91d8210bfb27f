"""The `trainyard` command line: `main` and its typer `app` (main.py), the job commands (jobs.py),
access and admin commands (access.py), the API client and code shipping they use, and the views
they print. A tool: nothing below it (the wire contract, storage, the control plane, the agent, the
worker runtime) imports it."""

from trainyard.cli.main import app, main

__all__ = ["app", "main"]
