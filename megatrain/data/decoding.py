"""Text decoding, counted: what is not UTF-8 becomes U+FFFD, and every file says how much.

A text or JSONL file is read as UTF-8. A byte that is not UTF-8 (a Latin-1 ``é``, a cut
multi-byte sequence) becomes the replacement character U+FFFD, as it always has; so does a lone
surrogate escape in a JSON string (``"\\ud83d"``, half of an emoji pair cut by a JavaScript
writer), which no tokenizer can encode. Each is counted here, per file, so the change is never
silent: the count goes into the unit's record and the shard index (``replaced_bytes``), and
from there into ``megatrain status`` and the campaign report. Above ``data.max_replaced_fraction``
of a file's bytes the file is a bad source (``data.on_bad_source``): it was not UTF-8 text.

The text produced is exactly what ``bytes.decode("utf-8", errors="replace")`` gives, so a
version sharded before the counting reads the same documents.
"""

from __future__ import annotations

import re
import sysconfig
from dataclasses import dataclass

from megatrain.data.index import DataError

REPLACEMENT = "\ufffd"
DEFAULT_MAX_REPLACED_FRACTION = 0.001  # data.max_replaced_fraction's default: one byte in a thousand
_ESCAPED = re.compile("[\udc80-\udcff]")  # surrogateescape's stand-ins: one per byte that is not UTF-8
_SURROGATE = re.compile("[\ud800-\udfff]")  # in a str from JSON: an unpaired surrogate escape
_STDLIB = sysconfig.get_paths()["stdlib"].rstrip("/") + "/"


@dataclass
class Tally:
    """One file's (or one file part's) decoding: its bytes, and how many were replaced."""

    bytes: int = 0
    replaced: int = 0


def decode(data: bytes, tally: Tally) -> str:
    """``data`` as UTF-8 with replacement characters, its replaced bytes counted into ``tally``."""
    text = data.decode("utf-8", errors="replace")
    tally.bytes += len(data)
    if REPLACEMENT in text:  # only then look closer: a real U+FFFD in the text is no replaced byte
        tally.replaced += len(_ESCAPED.findall(data.decode("utf-8", errors="surrogateescape")))
    return text


def without_surrogates(value: str, tally: Tally) -> str:
    """A string from JSON with each unpaired surrogate replaced by U+FFFD (counted): a tokenizer
    refuses such a string with a TypeError that names neither the file nor the line."""
    found = len(_SURROGATE.findall(value))
    if not found:
        return value
    tally.replaced += found
    return _SURROGATE.sub(REPLACEMENT, value)


def is_known_text(url: str) -> bool:
    """The standard library's own files (the ``stdlib`` source): a few of its tests are Latin-1 or
    KOI8-R on purpose. They are counted like any file but never refused, so the default corpus
    stays what it has always been."""
    return url.startswith(_STDLIB)


def check(url: str, tally: Tally, max_fraction: float | None) -> None:
    """A DataError naming the file when more than ``max_fraction`` of its bytes were replaced."""
    if max_fraction is None or is_known_text(url) or tally.replaced <= max_fraction * tally.bytes:
        return
    raise DataError(f"{url}: {tally.replaced} of its {tally.bytes:,} bytes are not UTF-8 (they would become U+FFFD; "
                    f"more than data.max_replaced_fraction={max_fraction:g}): re-encode it as UTF-8 "
                    f"(iconv -f latin1 -t utf-8, if it is Latin-1), or raise the limit")
