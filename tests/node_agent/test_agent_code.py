"""A job's shipped code through the agent's loops (issue 23, finding 4): fetched and unpacked in the
part's own thread, so the node's heartbeats go on while a slow download and a big archive take
their time; an archive over the node's caps fails its job at once, with the reason."""

from __future__ import annotations

import gzip
import hashlib
import io
import stat
import tarfile

from tests.node_agent.fake_control_plane import FakeControlPlane
from tests.node_agent.helpers import make_spec, wait_for
from tests.node_agent.test_agent import NODE, Agents, agents, plane, wait_state  # noqa: F401 (fixtures)
from trainyard.protocol.agent import CodeRef, NodeAttemptState

TRAIN = "import os\nprint('files', len(os.listdir('many')), flush=True)\n"


def _code(files: int) -> bytes:
    """train.py and ``files`` empty files below many/."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w:gz", compresslevel=1) as tar:
        info = tarfile.TarInfo("train.py")
        info.size = len(TRAIN)
        tar.addfile(info, io.BytesIO(TRAIN.encode()))
        for i in range(files):
            tar.addfile(tarfile.TarInfo(f"many/f{i}"))
    return raw.getvalue()


def _bomb() -> bytes:
    """A header that announces 5 GiB of zeros (what follows it never matters: the cap stops first)."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        info = tarfile.TarInfo("zeros")
        info.size = 5 << 30
        tar.addfile(info)
    return gzip.compress(raw.getvalue())


def _ref(data: bytes) -> CodeRef:
    return CodeRef(sha256=hashlib.sha256(data).hexdigest(), size_bytes=len(data))


def test_heartbeats_go_on_while_code_downloads_and_unpacks_and_a_bomb_fails_its_job(agents: Agents,  # noqa: F811
                                                                                  plane: FakeControlPlane) -> None:  # noqa: F811
    cache = agents.tmp_path / "agent" / "code"
    cache.mkdir(parents=True, mode=0o755)  # as an agent before issue 23 left it: listable by every uid
    agents.start()
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700  # closed at start, before any job runs
    wait_for(lambda: len(plane.heartbeat_times) >= 3, what="the agent's first heartbeats")
    slow, bomb = _code(1500), _bomb()
    good = make_spec(entrypoint="train.py", nproc_per_node=1, gpu_indices=[0], code=_ref(slow))
    bad = make_spec(entrypoint="train.py", nproc_per_node=1, gpu_indices=[1], code=_ref(bomb))
    agents.attempt_ids |= {good.attempt_id, bad.attempt_id}
    plane.code = {good.attempt_id: slow, bad.attempt_id: bomb}
    plane.code_trickle_s = 3.0  # the download alone outlasts many heartbeat intervals (0.2 s)
    seen = len(plane.heartbeat_times)
    plane.assign(NODE, good, bad)

    failed = wait_state(plane, bad.attempt_id, NodeAttemptState.exited, timeout=60)
    assert failed.error is not None and "unpacks to more than 4.0 GiB" in failed.error
    assert failed.error_kind == "start_error"  # the job fails at once: no other attempt would do better
    done = wait_state(plane, good.attempt_id, NodeAttemptState.exited, timeout=120)
    assert done.exit_code == 0 and done.error is None
    assert plane.log_text(good.attempt_id, 0, 0, "stdout") == "files 1500\n"
    times = plane.heartbeat_times[seen:]
    window = times[-1] - times[0]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert window >= 3.0 and max(gaps) < 1.5, (window, max(gaps))
    assert sorted(p.name for p in cache.iterdir()) == sorted(f"{_ref(d).sha256}.tar.gz" for d in (slow, bomb))
    assert {stat.S_IMODE(p.stat().st_mode) for p in cache.iterdir()} == {0o600}
