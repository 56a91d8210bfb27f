"""Confining attempt parts: a uid and cgroups per part (isolation.py, cgroups.py), resource limits
(limits.py, part_limits.py), the exec wrapper that applies them (confine_exec.py), which interpreters
may run, and reading files that workers wrote (safe_files.py).

confine_exec.py runs as a script (``python -I -S``), and standby.py imports cgroups.py: keep this
package's ``__init__`` free of imports."""
