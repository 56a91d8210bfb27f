"""Tail each rank's stdout/stderr files and cut them into LogChunks keyed by byte offset.

Offsets advance only when the control plane acknowledges a batch, so a failed send is simply
read again and resent; the control plane stores a (rank, stream, offset) chunk once.

The files are the workers' (their directory, their uid): each is opened without following a link
and only when it is a regular file of the attempt's uid (safe_files.py), so a worker cannot have
the agent ship it something else, such as the agent's own environment.
"""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

from node_agent.confinement import safe_files
from trainyard.protocol.agent import LogChunk

CHUNK_BYTES = 64 * 1024
BATCH_BYTES = 256 * 1024
_RANK_DIR = re.compile(r"^rank-(\d+)$")
STREAMS = ("stdout", "stderr")


@dataclass(frozen=True)
class PendingChunk:
    chunk: LogChunk
    nbytes: int
    """Bytes of the file this chunk covers (not len(data): decoding may replace bytes)."""


def _sequence_length(lead: int) -> int:
    if lead & 0xE0 == 0xC0:
        return 2
    if lead & 0xF0 == 0xE0:
        return 3
    if lead & 0xF8 == 0xF0:
        return 4
    return 1  # ASCII, or an invalid lead byte that decoding replaces on its own


def complete_utf8_prefix(data: bytes) -> int:
    """Length of the longest prefix of `data` that does not end inside a UTF-8 sequence.

    A chunk boundary inside a multi-byte character would turn both halves into U+FFFD.
    """
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 != 0x80:  # not a continuation byte: the start of the last character
            needed = _sequence_length(byte)
            return len(data) if back >= needed else len(data) - back
    return len(data)  # only continuation bytes: invalid anyway, send as is


class LogTailer:
    def __init__(
        self, log_dir: Path, *, chunk_bytes: int = CHUNK_BYTES, batch_bytes: int = BATCH_BYTES, owner: int | None = None
    ) -> None:
        self.log_dir = log_dir
        self.owner = owner
        """The uid the files must belong to (the attempt's), or None: any."""
        self.chunk_bytes = chunk_bytes
        self.batch_bytes = batch_bytes
        self._acked: dict[tuple[int, str], int] = {}

    def _files(self) -> list[tuple[int, str]]:
        found: list[tuple[int, str]] = []
        for name in safe_files.list_dir(self.log_dir):
            match = _RANK_DIR.match(name)
            if match is None:
                continue
            files = safe_files.list_dir(self.log_dir, name)
            found += [(int(match.group(1)), stream) for stream in STREAMS if f"{stream}.log" in files]
        return sorted(found)

    def _open(self, rank: int, stream: str) -> int | None:
        try:
            return safe_files.open_file(self.log_dir, f"rank-{rank}", f"{stream}.log", owner=self.owner)
        except OSError:
            return None  # gone, or not a file the agent will read

    def next_batch(self, *, final: bool = False) -> list[PendingChunk]:
        """Unacknowledged bytes, up to the batch budget. `final`: the writers are gone, so a
        trailing partial character is all there will ever be and is sent too."""
        batch: list[PendingChunk] = []
        budget = self.batch_bytes
        for rank, stream in self._files():
            offset = self._acked.get((rank, stream), 0)
            fd = self._open(rank, stream)
            if fd is None:
                continue
            with contextlib.closing(os.fdopen(fd, "rb")) as f:
                f.seek(offset)
                while budget > 0:
                    want = min(self.chunk_bytes, budget)
                    data = f.read(want)
                    if not data:
                        break
                    at_end = len(data) < want and not f.read(1)
                    n = len(data) if final and at_end else complete_utf8_prefix(data)
                    if n == 0:
                        break
                    text = data[:n].decode("utf-8", errors="replace")
                    batch.append(PendingChunk(LogChunk(rank=rank, stream=stream, offset=offset, data=text), n))
                    offset += n
                    budget -= n
                    f.seek(offset)
            if budget <= 0:
                break
        return batch

    def acknowledge(self, batch: list[PendingChunk]) -> None:
        for pending in batch:
            key = (pending.chunk.rank, pending.chunk.stream)
            end = pending.chunk.offset + pending.nbytes
            if end > self._acked.get(key, 0):
                self._acked[key] = end
