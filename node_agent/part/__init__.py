"""One attempt part's life on this node: ``Part`` (attempt.py), its command lines and
environment (commands.py), setting parts up, adopting and finishing them (parts.py), handing parked
workers over (handover.py), and the job's shipped code, venv and logs."""
