"""``trainyard dev up``: a whole cluster on this machine, in the foreground.

Order of start: PostgreSQL (embedded unless a URL is given), S3 (embedded ``weed mini`` unless an
endpoint is given), migrations, a local CA and the server certificate (trainyard/dev/certs.py), the
control plane over HTTPS (``python -m trainyard server --tls-cert ...``; plain HTTP with
``--insecure-http``), one agent per node (``python -m trainyard agent --ca-file ...``, node i at
127.0.0.(i+1) with virtual GPU slots). Stop is the reverse, on Ctrl-C, SIGTERM, or when the
control plane, PostgreSQL or S3 dies (then the exit status is 1). A node agent that dies is
reported and the cluster keeps running (the control plane declares the node lost and recovers its
jobs); ``trainyard dev node kill|kill-workers|restart NODE`` acts on a node of the running cluster
(trainyard/dev/control.py).

The parts: config.py (DevConfig), services.py (PostgreSQL, S3, migrations), nodes.py (the agents),
cluster.py (DevCluster: the order of start and stop, the control plane), base.py (what they share).

Layout of the data dir::

    DIR/postgres/      PGDATA (kept: a second ``dev up`` on DIR reuses the database)
    DIR/s3/            SeaweedFS data; DIR/s3-credentials.json its keys (0600)
    DIR/tls/           ca.pem (give it to clients: curl --cacert), ca-key.pem, server.pem, server-key.pem,
                       node-i.pem and node-i-key.pem (each agent's memory port: TLS between agents)
    DIR/logs/NAME.log  output of each process (control-plane, node-1, ..., s3)
    DIR/nodes/node-i/  each agent's work dir (and its workers' directories, when every directory
                       above DIR lets other users through; else under the temporary directory)
    DIR/dev-up.lock    held while a ``dev up`` runs on DIR; DIR/dev-up.pids its children
    DIR/admin.token    the admin token (0600): trainyard login URL --token-file DIR/admin.token
    DIR/control/       requests to the running ``dev up`` (trainyard/dev/control.py)
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from trainyard.dev.cluster import DevCluster
from trainyard.dev.config import (
    DEV_WORKER_UIDS,
    NOT_ISOLATED,
    READY_MARKER,
    SECRET_ENV,
    DevConfig,
    DevError,
    _Interrupted,
)
from trainyard.dev.nodes import _PoolCheck

__all__ = ["DEV_WORKER_UIDS", "NOT_ISOLATED", "READY_MARKER", "SECRET_ENV", "DevCluster", "DevConfig", "DevError",
           "_PoolCheck", "run_dev_up"]


def run_dev_up(config: DevConfig, out: IO[str] | None = None) -> int:
    """Run a dev cluster until Ctrl-C/SIGTERM (exit status 0) or until a part of it dies (1).

    Raises DevError when it cannot start (after stopping whatever it had started).
    """
    config.data_dir.mkdir(parents=True, exist_ok=True)
    cluster = DevCluster(config, out)
    with _data_dir_lock(config.data_dir), _stop_on_signals(cluster):
        try:
            cluster.start()
            cluster.announce()
            return cluster.watch()
        except _Interrupted:
            return 0
        finally:
            cluster.stop()


@contextlib.contextmanager
def _stop_on_signals(cluster: DevCluster) -> Iterator[None]:
    def handler(signum: int, frame: Any) -> None:
        cluster.request_stop()

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


@contextlib.contextmanager
def _data_dir_lock(data_dir: Path) -> Iterator[None]:
    path = data_dir / "dev-up.lock"
    with open(path, "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            owner = fh.read().strip() or "?"
            raise DevError(f"{data_dir} is in use by another 'trainyard dev up' (pid {owner})") from None
        fh.seek(0)
        fh.truncate()
        fh.write(str(os.getpid()))
        fh.flush()
        try:
            yield
        finally:
            fh.truncate(0)
