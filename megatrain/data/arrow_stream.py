"""An Arrow IPC stream (a ``datasets`` data file) read by row range, its bodies skipped unread.

A large Arrow data file is cut into row-range work units (``sources.plan_units``). Planning needs
each record batch's rows and bytes, and a unit needs only the batches holding its rows; reading
the whole stream for either would read the file once per unit. So this walks the stream's
messages by their headers alone: each message is

    0xFFFFFFFF, int32 metadata size, a ``Message`` flatbuffer (padded), then bodyLength bytes

(streams written before Arrow 0.15 have no 0xFFFFFFFF), and only three numbers are read out of
the flatbuffer: the header's kind, the body's length and a record batch's row count. A batch a
unit needs is decoded by pyarrow itself, from the stream's schema and dictionary messages
followed by that one batch: a stream of its own.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

CONTINUATION = b"\xff\xff\xff\xff"
EOS = CONTINUATION + b"\x00\x00\x00\x00"
SCHEMA, DICTIONARY, RECORD_BATCH = 1, 2, 3  # Message.header's union type (Message.fbs)


@dataclass(frozen=True)
class Message:
    offset: int  # where the message starts in the file (at its 0xFFFFFFFF, or its size if legacy)
    length: int  # the whole message: prefix, metadata and body
    kind: int  # SCHEMA, DICTIONARY, RECORD_BATCH (others are not in a datasets file)
    rows: int  # a record batch's rows (0 otherwise)


def _field(buf: bytes, table: int, slot: int) -> int | None:
    """Where field ``slot`` of the flatbuffer table at ``table`` lies, or None when it is absent."""
    vtable = table - struct.unpack_from("<i", buf, table)[0]
    size = struct.unpack_from("<H", buf, vtable)[0]
    if 4 + 2 * slot >= size:
        return None
    at = struct.unpack_from("<H", buf, vtable + 4 + 2 * slot)[0]
    return table + at if at else None


def _parse(buf: bytes) -> tuple[int, int, int]:
    """(header kind, body length, record batch rows) of a ``Message`` flatbuffer."""
    message = struct.unpack_from("<I", buf, 0)[0]
    kind_at, header_at, body_at = (_field(buf, message, slot) for slot in (1, 2, 3))
    kind = buf[kind_at] if kind_at is not None else 0
    body = struct.unpack_from("<q", buf, body_at)[0] if body_at is not None else 0
    rows = 0
    if kind == RECORD_BATCH and header_at is not None:
        batch = header_at + struct.unpack_from("<I", buf, header_at)[0]
        length_at = _field(buf, batch, 0)  # RecordBatch.length
        rows = struct.unpack_from("<q", buf, length_at)[0] if length_at is not None else 0
    return kind, body, rows


def messages(stream: IO[bytes]) -> Iterator[Message]:
    """The stream's messages in order, reading 8 bytes and the metadata of each, seeking past bodies.
    A stream cut inside a message, or metadata that is not a Message, is a ValueError."""
    offset = 0
    while True:
        stream.seek(offset)
        prefix = stream.read(8)
        if len(prefix) < 4 or prefix[:4] == b"\x00\x00\x00\x00" or prefix == EOS:
            return  # the end of the stream (an EOS marker, or the file's end between messages)
        legacy = prefix[:4] != CONTINUATION
        size = struct.unpack_from("<i", prefix, 0 if legacy else 4)[0]
        start = offset + (4 if legacy else 8)
        stream.seek(start)
        metadata = stream.read(size)
        if size <= 0 or len(metadata) < size:
            raise ValueError(f"a message at byte {offset} is cut short ({len(metadata)} of {size} metadata bytes)")
        try:
            kind, body, rows = _parse(metadata)
        except (struct.error, IndexError) as exc:
            raise ValueError(f"the message at byte {offset} has no readable header ({exc})") from exc
        length = start + size + body - offset
        yield Message(offset, length, kind, rows)
        offset += length


def batch_sizes(stream: IO[bytes]) -> list[tuple[int, int]]:
    """(rows, bytes) of each record batch, from the headers alone."""
    return [(m.rows, m.length) for m in messages(stream) if m.kind == RECORD_BATCH]


def read_rows(stream: IO[bytes], first: int, stop: int) -> Iterator[Any]:
    """The record batches holding rows [first, stop) of the stream, each sliced to those rows;
    only their bodies (and the schema and dictionaries) are read."""
    import pyarrow as pa

    preamble: list[bytes] = []  # the schema, and every dictionary so far: what a batch needs to decode
    row = 0
    for message in messages(stream):
        if row >= stop:
            return
        if message.kind != RECORD_BATCH:
            if message.kind in (SCHEMA, DICTIONARY):
                stream.seek(message.offset)
                preamble.append(stream.read(message.length))
            continue
        begin, end = row, row + message.rows
        row = end
        if end <= first:
            continue
        stream.seek(message.offset)
        body = stream.read(message.length)
        if len(body) < message.length:
            raise ValueError(f"the record batch at byte {message.offset} is cut short")
        batch = pa.ipc.open_stream(pa.py_buffer(b"".join([*preamble, body, EOS]))).read_next_batch()
        low, high = max(first, begin) - begin, min(stop, end) - begin
        yield batch.slice(low, high - low)
