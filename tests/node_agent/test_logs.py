"""Log tailing: byte offsets, chunk sizes, UTF-8 boundaries, resend until acknowledged."""

from __future__ import annotations

from pathlib import Path

from node_agent.part.logs import LogTailer, complete_utf8_prefix


def write(root: Path, rank: int, stream: str, data: bytes) -> None:
    path = root / f"rank-{rank}" / f"{stream}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("ab") as f:
        f.write(data)


def test_complete_utf8_prefix() -> None:
    euro = "€".encode()  # 3 bytes
    assert complete_utf8_prefix(b"abc") == 3
    assert complete_utf8_prefix(b"ab" + euro) == 5
    assert complete_utf8_prefix(b"ab" + euro[:2]) == 2
    assert complete_utf8_prefix(b"ab" + euro[:1]) == 2
    assert complete_utf8_prefix("😀".encode()[:3]) == 0


def test_offsets_advance_only_when_acknowledged(tmp_path: Path) -> None:
    tailer = LogTailer(tmp_path)
    assert tailer.next_batch() == []
    write(tmp_path, 0, "stdout", b"hello\n")
    write(tmp_path, 1, "stderr", b"oops\n")
    batch = tailer.next_batch()
    assert [(p.chunk.rank, p.chunk.stream, p.chunk.offset, p.chunk.data) for p in batch] == [
        (0, "stdout", 0, "hello\n"),
        (1, "stderr", 0, "oops\n"),
    ]
    assert [p.chunk for p in tailer.next_batch()] == [p.chunk for p in batch]  # not acked: resent
    tailer.acknowledge(batch)
    assert tailer.next_batch() == []
    write(tmp_path, 0, "stdout", b"more")
    (again,) = tailer.next_batch()
    assert (again.chunk.offset, again.chunk.data) == (6, "more")


def test_chunks_are_capped_and_never_split_a_character(tmp_path: Path) -> None:
    tailer = LogTailer(tmp_path, chunk_bytes=10, batch_bytes=25)
    data = ("a" * 9 + "€" + "b" * 20).encode()
    write(tmp_path, 0, "stdout", data)
    first = tailer.next_batch()
    assert [p.nbytes for p in first] == [9, 10, 6]  # the 2nd chunk starts at the euro sign
    assert first[1].chunk.data.startswith("€")
    tailer.acknowledge(first)
    rest = tailer.next_batch()
    tailer.acknowledge(rest)
    text = "".join(p.chunk.data for p in first + rest)
    assert text == data.decode() and "\ufffd" not in text


def test_trailing_partial_character_waits_unless_final(tmp_path: Path) -> None:
    tailer = LogTailer(tmp_path)
    write(tmp_path, 0, "stdout", b"x" + "€".encode()[:2])
    (only,) = tailer.next_batch()
    assert only.chunk.data == "x"
    tailer.acknowledge([only])
    assert tailer.next_batch() == []
    (last,) = tailer.next_batch(final=True)  # the writer is gone: what is there is all there is
    assert last.chunk.offset == 1 and last.nbytes == 2 and last.chunk.data == "\ufffd"
