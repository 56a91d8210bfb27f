"""Trainyard node agent: runs the control plane's attempts on one node.

- ``agent.py``: the ``Agent`` (its lifecycle, and the loops composed over its state) and ``run_agent``;
  ``config.py`` (``AgentConfig``), ``options.py`` (the one command line: ``trainyard agent``, also
  ``python -m node_agent``), ``gpus.py`` (NVML or virtual slots).
- ``loops/``: the agent's loops (heartbeat and desired state, supervision, reports) and their state.
- ``link/``: the link to the control plane: the client, the node credential, the outbox and relay.
- ``local/``: the workers' local API, one unix socket per attempt part.
- ``part/``: one attempt part's life: its processes (``Part``), their command lines, setting
  parts up, adopting them, handing them over; the job's code and venv.
- ``ranks/``: the processes a part is made of (torchrun's entry, the rank shim, warm standbys) and
  finding them (process tables, orphans).
- ``confinement/``: a uid, cgroups and limits per part, confine_exec, files read safely.
- ``memtier/``: the in-memory checkpoint tier (its budget, store, local routes, peer port).

``rank_shim.py``, ``torchrun_entry.py``, ``standby.py`` and ``confine_exec.py`` here are the old
names of modules in ``ranks/`` and ``confinement/``, kept for processes an earlier agent started
(ranks/entry_points.py says why).
"""
