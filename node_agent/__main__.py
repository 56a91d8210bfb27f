"""``python -m node_agent``: the same command as ``trainyard agent``, with the same options
(node_agent/options.py); docs name ``trainyard agent``."""

from __future__ import annotations

import sys

from node_agent.options import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m node_agent"))
