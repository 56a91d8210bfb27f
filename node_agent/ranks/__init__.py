"""The processes an attempt part is made of: torchrun (torchrun_entry.py), one rank shim per rank
(shim.py), warm standbys (standby*.py); and finding a part's processes (processes.py, orphans.py).

The shim, the standby and torchrun's entry must stay import-light: keep this package's ``__init__``
free of imports."""
