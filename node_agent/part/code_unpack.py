"""Unpack a job's code archive, read from stdin, into a new directory, within caps.

    python -I -S -c <this file's source> INTO MAX_BYTES MAX_ENTRIES

Run by the agent (node_agent/part/code.py) through confine_exec.py, so as the attempt's uid, in its
cgroup: the archive's bytes are a tenant's, and root never parses them. Root opens the archive in
its private cache and hands this process the open file as stdin: the uid needs no access to the
cache. The time cap is the agent's (it kills this process).

Streamed (``r|gz``): every member's declared size and the number of members are counted before it
is written, so an archive of zeros declaring 100 GiB, or a million empty files, stops at the cap
with nothing more written than the cap allows. Extracted with tarfile's ``data`` filter: no absolute
paths, no ``..``, no links out of the folder, no device files, no setuid bits.

Exit 0: done. Exit 3: over a cap or not a usable archive (the job's own fault: retrying cannot
help); the one line on stderr says which. Standard library only, run with ``-I -S``, no file of
the agent's read: it must work as a uid that cannot read the agent's code.
"""

from __future__ import annotations

import os
import sys
import tarfile

EXIT_REFUSED = 3


def _refuse(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
    os._exit(EXIT_REFUSED)


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def unpack(into: str, max_bytes: int, max_entries: int) -> None:
    os.mkdir(into, 0o700)
    total = entries = 0
    try:
        with tarfile.open(fileobj=sys.stdin.buffer, mode="r|gz") as tar:
            for member in tar:
                entries += 1
                if entries > max_entries:
                    _refuse(f"the job's code archive holds more than {max_entries} entries "
                            f"(this node's limit, --code-max-entries)")
                total += max(member.size, 0)
                if total > max_bytes:
                    _refuse(f"the job's code archive unpacks to more than {_size(max_bytes)} "
                            f"(this node's limit, --code-max-gb): {member.name!r} brings it to {_size(total)}")
                tar.extract(member, into, filter="data")
    except (tarfile.TarError, EOFError, OSError, ValueError) as exc:
        _refuse(f"the job's code archive could not be unpacked: {type(exc).__name__}: {exc}")


if __name__ == "__main__":
    if len(sys.argv) != 4:
        _refuse("usage: code_unpack INTO MAX_BYTES MAX_ENTRIES")
    unpack(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
