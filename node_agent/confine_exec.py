"""confine_exec.py's earlier path: it is node_agent/confinement/confine_exec.py, kept for an earlier
agent that still runs while its package is upgraded in place (node_agent/ranks/entry_points.py).

Run like it, as root with ``python -I -S`` (no package on the path, no site): it runs the file
beside it by path and imports nothing else.
"""

import os
import runpy

if __name__ == "__main__":
    runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "confinement", "confine_exec.py"),
                   run_name="__main__")
