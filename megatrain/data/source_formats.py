"""What a corpus file holds, told by its bytes, and the documents inside each kind of file.

Names lie (gzip bytes named ``.parquet`` were once tokenized as gzip header bytes), so the first
bytes decide: ``identify`` reads the head of a file (and the tail of a Parquet file) and answers its
kind and compression, or raises a DataError that starts with the URL and says what the file looks
like. The readers below turn a text or JSONL file, or a byte range of one, into documents (their
text decoding counted: ``decoding.py``); Parquet and Arrow are read by ``table_formats.py``.

Every byte comes through ``megatrain.storage``, and a failure of the storage itself stays a
StorageError (an outage: a retry may help) and is never mistaken for a broken file (a DataError,
which ``on_bad_source: skip`` would drop: an outage must not silently change the corpus). Decoder
failures (zlib, zstandard, pyarrow) become one DataError naming the file, the library's exception
chained as its cause. No torch here: this runs in tokenizer worker processes.
"""

from __future__ import annotations

import codecs
import contextlib
import gzip
import io
import json
import logging
import zlib
from collections.abc import Iterator
from typing import IO, Any

import zstandard

from megatrain import storage
from megatrain.data import decoding
from megatrain.data.decoding import Tally
from megatrain.data.index import DataError
from megatrain.errors import UnsafePathError
from megatrain.storage.urls import describe, errors_name

log = logging.getLogger(__name__)

HEAD = 64 << 10  # bytes read to identify a file (and decompressed bytes looked at inside it)
MAX_UNDECODABLE = 0.01  # more replacement characters than this share of the head: not UTF-8 text
CHUNK = 1 << 20  # read size of the streaming readers
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py")
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
COMPRESSION_SUFFIXES = {".gz": "gzip", ".zst": "zstd"}

# Magic bytes -> what is read: gzip and zstd streams are decompressed, Parquet is read by column.
_READ = ((b"\x1f\x8b", "gzip"), (b"\x28\xb5\x2f\xfd", "zstd"), (b"PAR1", "parquet"))
# Compressed or archived bytes of a format megatrain does not read (recompressing is the user's fix).
_UNREAD_COMPRESSION = (
    (b"\xfd7zXZ\x00", "xz"), (b"\x04\x22\x4d\x18", "lz4"), (b"7z\xbc\xaf\x27\x1c", "7z"),
    (b"PK\x03\x04", "zip"), (b"PK\x05\x06", "zip"), (b"\xff\x06\x00\x00sNaPpY", "snappy"),
    (b"\x78\x01", "zlib"), (b"\x78\x9c", "zlib"), (b"\x78\xda", "zlib"),
)
# Binary formats worth naming in the error (any other binary is refused by its NUL bytes).
_BINARY = (
    (b"\x89PNG\r\n\x1a\n", "PNG image"), (b"\xff\xd8\xff", "JPEG image"), (b"GIF87a", "GIF image"),
    (b"GIF89a", "GIF image"), (b"%PDF-", "PDF document"), (b"\x7fELF", "ELF executable"),
    (b"\xcf\xfa\xed\xfe", "Mach-O executable"), (b"\xca\xfe\xba\xbe", "Java class or Mach-O executable"),
    (b"\x00asm", "WebAssembly module"), (b"SQLite format 3\x00", "SQLite database"),
    (b"ARROW1", "Arrow IPC file"), (b"\x93NUMPY", "NumPy array"), (b"OggS", "Ogg media"),
    (b"\xff\xff\xff\xff", "Arrow IPC stream: name the dataset folder that holds state.json"),
)


# ------------------------------------------------------------------------------- identify
def identify(url: str, size: int) -> tuple[str, str | None]:
    """(kind, compression) of the file at ``url``, read from its content; a DataError if it is refused."""
    named_kind, named_compression = name_says(url)
    head = read_range(url, 0, HEAD)
    tail = read_range(url, size - 4, size) if head.startswith(b"PAR1") and size >= 12 else b""
    magic = _magic(head)
    if magic == "parquet":
        if tail != b"PAR1":  # the footer (schema, row groups) ends the file: without it nothing can be read
            raise DataError(f"{url}: a broken Parquet file: it starts with PAR1 but does not end with it "
                            f"(truncated, or a damaged footer)")
        kind, compression = "parquet", None
    else:
        compression = magic if magic in ("gzip", "zstd") else None
        whole = len(head) >= size
        content, whole = _inflate_head(url, head, compression, whole) if compression else (head, whole)
        _refuse_binary(url, content, compression)
        kind = _text_or_jsonl(url, content, whole, named_kind)
    named = (named_kind, named_compression) != (None, None)
    if named and (named_kind not in (None, kind) or named_compression != compression):
        log.warning("%s: the name says %s but the content is %s: reading it by its content", url,
                    _shown(named_kind or "text", named_compression), _shown(kind, compression))
    return kind, compression


def read_range(url: str, start: int, end: int) -> bytes:
    """Bytes [start, end) in one ranged read: on an object store, opening the file would fetch a
    whole read-ahead block (5 MiB) to look at its first bytes."""
    fs, path = storage.resolve(url)
    with errors_name(url):
        return fs.cat_file(path, start=start, end=end)


def name_says(url: str) -> tuple[str | None, str | None]:
    """(kind, compression) that the file's name claims; None where it claims nothing."""
    name, compression = url.rsplit("/", 1)[-1], None
    for suffix, method in COMPRESSION_SUFFIXES.items():
        if name.endswith(suffix):
            name, compression = name[: -len(suffix)], method
    kind = ("parquet" if name.endswith(".parquet") else "jsonl" if name.endswith(JSONL_SUFFIXES)
            else "text" if name.endswith(TEXT_SUFFIXES) else None)
    return kind, compression


def _shown(kind: str, compression: str | None) -> str:
    return f"{compression}-compressed {kind}" if compression else kind


def _magic(head: bytes) -> str | None:
    return next((what for magic, what in _READ if head.startswith(magic)), None)


def _inflate_head(url: str, head: bytes, compression: str, whole: bool) -> tuple[bytes, bool]:
    """The first HEAD decompressed bytes, and whether they are all of it. When ``head`` is the
    whole file, the stream is read to its end (up to 16 MiB): a small truncated file is refused now."""
    stream, out, total, complete = decompressed(io.BytesIO(head), compression), bytearray(), 0, False
    try:
        with broken(url, f"corrupt or truncated {compression} data"):
            while not complete and total < (16 << 20 if whole else HEAD):
                piece = stream.read(8192)
                out += piece[: HEAD - len(out)]
                total, complete = total + len(piece), not piece
    except DataError as exc:
        if whole or not isinstance(exc.__cause__, EOFError):
            raise  # a partial head ending inside the stream is where we stopped reading: no error
    return bytes(out), complete and total <= HEAD


def _refuse_binary(url: str, content: bytes, compression: str | None) -> None:
    """A DataError naming what ``content`` (a file's first bytes, decompressed) looks like, unless text."""
    inside = f"{compression}-compressed " if compression else ""
    magic = _magic(content)
    if compression and magic:
        raise DataError(f"{url}: {magic} inside {compression}: compressed twice; only one gzip or zstd layer "
                        f"over text or JSONL is read (Parquet compresses its own pages: store it uncompressed)")
    bzip2 = content[:3] == b"BZh" and content[4:10] in (b"1AY&SY", b"\x17rE8P\x90")
    unread = "bzip2" if bzip2 else next((name for magic, name in _UNREAD_COMPRESSION
                                         if content.startswith(magic)), None)
    if unread:
        raise DataError(f"{url}: {inside}unknown compression ({unread}): only gzip and zstd are read; recompress it")
    known = "tar archive" if content[257:262] == b"ustar" else next(
        (name for magic, name in _BINARY if content.startswith(magic)), None)
    if known:
        raise DataError(f"{url}: {inside}binary ({known}), not text")
    if b"\x00" in content:
        utf16 = "; UTF-16 text? only UTF-8 is read" if content[:2] in (b"\xff\xfe", b"\xfe\xff") else ""
        raise DataError(f"{url}: {inside}binary (NUL bytes from offset {content.index(0)}{utf16}), not text")


def _text_or_jsonl(url: str, content: bytes, whole: bool, named_kind: str | None) -> str:
    """Refuse undecodable text; then JSONL if the name says so or the first line is a JSON object."""
    text = codecs.getincrementaldecoder("utf-8")(errors="replace").decode(content, final=whole)
    undecodable = text.count("\ufffd")
    if undecodable > MAX_UNDECODABLE * len(text):
        raise DataError(f"{url}: undecodable text: {undecodable} of the first {len(text)} characters are not "
                        f"UTF-8 (more than {MAX_UNDECODABLE:.0%}); only UTF-8 is read")
    lines = text.lstrip("\ufeff").split("\n")
    number, first = next(((n, line) for n, line in enumerate(lines, 1) if line.strip()), (0, ""))
    if number == 0 or (number == len(lines) and not whole):
        return named_kind if named_kind in ("text", "jsonl") else "text"  # no complete line to judge by
    try:
        is_object = isinstance(json.loads(first), dict)
    except ValueError:
        is_object = False
    if named_kind == "jsonl" and not is_object:  # found now, before anything is written
        raise DataError(f"{url}:{number}: not a JSON object, yet the name says JSONL (one object per line)")
    return named_kind if named_kind in ("text", "jsonl") else "jsonl" if is_object else "text"


# --------------------------------------------------------------------------------- streams
class Guarded(io.RawIOBase):
    """A storage file whose own failures are StorageErrors, whoever reads it (gzip, pyarrow):
    an outage is then never taken for a broken file."""

    def __init__(self, url: str) -> None:
        super().__init__()
        self.url, self._file = url, storage.open_url(url, "rb")

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        with errors_name(self.url):
            return self._file.read(size)

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def seek(self, offset: int, whence: int = 0) -> int:
        with errors_name(self.url):
            return self._file.seek(offset, whence)

    def tell(self) -> int:
        return self._file.tell()

    def close(self) -> None:
        if not self.closed and hasattr(self, "_file"):  # not when open_url itself failed
            self._file.close()
        super().close()


class _ZstdFrames(io.RawIOBase):
    """A zstd stream of one or more frames, decompressed as it is read. zstandard's own
    stream_reader ends quietly where a truncated file ends; this raises EOFError there, as gzip does."""

    def __init__(self, raw: IO[bytes]) -> None:
        super().__init__()
        self._raw, self._context = raw, zstandard.ZstdDecompressor()
        self._frame: Any = None
        self._out = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while not self._out:
            chunk = self._raw.read(CHUNK // 8)  # compressed bytes per step: bounds the output held
            if not chunk:
                if self._frame is not None and not self._frame.eof:
                    raise EOFError("the zstd stream ends inside a frame")
                return 0
            produced = []
            while chunk:
                if self._frame is None or self._frame.eof:  # a file may hold several frames (pzstd, appends)
                    self._frame = self._context.decompressobj()
                produced.append(self._frame.decompress(chunk))
                chunk = self._frame.unused_data if self._frame.eof else b""
            self._out = memoryview(b"".join(produced))
        n = min(len(buffer), len(self._out))
        buffer[:n], self._out = self._out[:n], self._out[n:]
        return n


def decompressed(raw: IO[bytes], compression: str | None) -> IO[bytes]:
    """A buffered binary stream of ``raw``'s content, decompressed as read (iterate it for lines)."""
    if compression == "gzip":
        return gzip.GzipFile(fileobj=raw, mode="rb")  # checks each member's CRC and length at its end
    return io.BufferedReader(_ZstdFrames(raw) if compression == "zstd" else raw, CHUNK)


@contextlib.contextmanager
def broken(url: str, what: str) -> Iterator[None]:
    """A decoder's failure -> one DataError naming the file (the library's exception chained)."""
    try:
        yield
    except (DataError, UnsafePathError, storage.StorageError):
        raise
    except (EOFError, OSError, ValueError, NotImplementedError, zlib.error, zstandard.ZstdError) as exc:
        raise DataError(f"{url}: {what} ({describe(exc)})") from exc


# ------------------------------------------------------------------------------ text, JSONL
def text_documents(url: str, compression: str | None, limit: int, tally: Tally | None = None) -> list[str]:
    """One file, one document (nothing for blank files); the first ``limit`` bytes if uncompressed.
    Bytes that are not UTF-8 become U+FFFD, counted into ``tally`` (decoding.py)."""
    with Guarded(url) as raw, broken(url, f"corrupt or truncated {compression} data"):
        data = decompressed(raw, compression).read(-1 if compression else limit)
    if b"\x00" in data:  # identify saw only the head
        raise DataError(f"{url}: binary (NUL bytes from offset {data.index(0)}), not text")
    text = decoding.decode(data, tally if tally is not None else Tally())
    return [text] if text.strip() else []


def jsonl_documents(url: str, compression: str | None, limit: int, text_field: str,
                    span: tuple[int, int] | None = None, tally: Tally | None = None) -> Iterator[str]:
    """The ``text_field`` of each line. Blank lines are skipped; a line that is not a JSON object
    with a string there is a DataError naming ``file:line`` (``file: the line at byte N`` in a
    span not starting at 0, where the line number is unknown). An empty string is no document.
    Bytes that are not UTF-8, and unpaired surrogate escapes, become U+FFFD, counted into ``tally``."""
    tally = tally if tally is not None else Tally()
    start, stop = span or (0, limit)
    with Guarded(url) as raw, broken(url, f"corrupt or truncated {compression or 'JSONL'} data"):
        for number, (offset, line) in enumerate(_lines(raw, compression, limit, start, stop), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(decoding.decode(line, tally).lstrip("\ufeff"))
                value = record[text_field] if isinstance(record, dict) else None
            except (ValueError, KeyError) as exc:
                value = exc
            if isinstance(value, str):
                if value:
                    yield decoding.without_surrogates(value, tally)
                continue
            where = f"{url}:{number}" if start == 0 else f"{url}: the line at byte {offset}"
            why = (f"not JSON ({value})" if isinstance(value, ValueError)
                   else f"no {text_field!r} field (data.text_field)" if isinstance(value, KeyError)
                   else "not a JSON object" if not isinstance(record, dict)
                   else f"field {text_field!r} is {type(value).__name__}, not a string")
            raise DataError(f"{where}: {why}")


def _lines(raw: IO[bytes], compression: str | None, limit: int, start: int, stop: int) -> Iterator[tuple[int, bytes]]:
    """(offset, line) for the lines starting in [start, stop) that end within ``limit`` bytes (a
    last line cut by max_source_bytes is dropped); a compressed stream: every line."""
    if compression:
        offset = 0
        for line in decompressed(raw, compression):
            yield offset, line
            offset += len(line)
        return
    stream, offset = io.BufferedReader(raw, CHUNK), start
    if start > 0:
        stream.seek(start - 1)
        if stream.read(1) != b"\n":  # inside a line: it started in the span before, so it is that span's
            offset += len(stream.readline())
    while offset < stop:
        line = stream.readline()
        if not line or offset + len(line) > limit:
            return
        yield offset, line
        offset += len(line)


@contextlib.contextmanager
def guarded(url: str, what: str) -> Iterator[IO[bytes]]:
    """The file at ``url`` as a seekable stream whose storage failures stay StorageErrors and whose
    decoding failures are one DataError ``<url>: <what> (...)``."""
    with Guarded(url) as raw, broken(url, what):
        yield raw  # type: ignore[misc]
