"""Tail each rank's stdout/stderr files and cut them into LogChunks keyed by byte offset.

Offsets advance only when the control plane acknowledges a batch, so a failed send is simply
read again and resent; the control plane stores a (rank, stream, offset) chunk once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

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
    def __init__(self, log_dir: Path, *, chunk_bytes: int = CHUNK_BYTES, batch_bytes: int = BATCH_BYTES) -> None:
        self.log_dir = log_dir
        self.chunk_bytes = chunk_bytes
        self.batch_bytes = batch_bytes
        self._acked: dict[tuple[int, str], int] = {}

    def _files(self) -> list[tuple[int, str, Path]]:
        found: list[tuple[int, str, Path]] = []
        if not self.log_dir.is_dir():
            return found
        for rank_dir in self.log_dir.iterdir():
            match = _RANK_DIR.match(rank_dir.name)
            if match is None:
                continue
            for stream in STREAMS:
                path = rank_dir / f"{stream}.log"
                if path.is_file():
                    found.append((int(match.group(1)), stream, path))
        return sorted(found)

    def next_batch(self, *, final: bool = False) -> list[PendingChunk]:
        """Unacknowledged bytes, up to the batch budget. `final`: the writers are gone, so a
        trailing partial character is all there will ever be and is sent too."""
        batch: list[PendingChunk] = []
        budget = self.batch_bytes
        for rank, stream, path in self._files():
            offset = self._acked.get((rank, stream), 0)
            try:
                with path.open("rb") as f:
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
            except FileNotFoundError:
                continue
            if budget <= 0:
                break
        return batch

    def acknowledge(self, batch: list[PendingChunk]) -> None:
        for pending in batch:
            key = (pending.chunk.rank, pending.chunk.stream)
            end = pending.chunk.offset + pending.nbytes
            if end > self._acked.get(key, 0):
                self._acked[key] = end
