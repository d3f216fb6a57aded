"""A Parquet file or an Arrow folder -> work units of about ``target_bytes``, from metadata alone.

Its pieces are row groups (Parquet: compressed sizes and rows from the footer) or data files
(Arrow: sizes from storage). Consecutive pieces are grouped until a unit holds ``target_bytes``.
A piece much larger than a unit (more than ``SPLIT`` units' worth, and at least two
``group_bytes``) stands alone and is cut into row ranges: otherwise one 500 MB data file of a
``save_to_disk`` folder, or the single row group pandas writes, is one unit that a single worker
tokenizes while the others wait. The ranges are balanced by bytes: a Parquet row group's rows
evenly (the footer knows no row sizes), an Arrow data file's by its record batches' bytes, read
from the stream's message headers (``arrow_stream.py``: no batch body is read).
"""

from __future__ import annotations

from megatrain import storage
from megatrain.data import arrow_stream
from megatrain.data import table_formats as tables
from megatrain.data.source_formats import guarded

SPLIT = 1.5  # a piece above this many units' bytes is cut into row ranges


Part = tuple[int, int]


def tabular_units(file, text_field: str | None, target_bytes: int,
                  group_bytes: int) -> list[tuple[Part, int, Part | None]]:
    """The file's units as (pieces [first, stop), estimated bytes, rows [first, stop) of that one
    piece or None for whole pieces); a DataError (the text column, broken metadata) raises."""
    units = []
    for (first, stop), weight in cut(piece_sizes(file, text_field), target_bytes, group_bytes):
        spans = row_spans(file, first, weight, target_bytes, group_bytes) if stop - first == 1 else []
        if len(spans) > 1:
            units += [((first, stop), share, rows) for rows, share in spans]
        else:
            units.append(((first, stop), weight, None))
    return units


def piece_sizes(file, text_field: str | None) -> list[int]:
    """Bytes of each row group (Parquet) or data file (Arrow), read from metadata."""
    if file.kind == "parquet":
        return [size for size, _ in tables.parquet_row_groups(file.url, text_field)]
    if text_field is not None:
        tables.check_arrow_features(file.url, text_field)
    return [storage.size(url) for url in tables.arrow_data_files(file.url)]


def splits(size: int, target_bytes: int, group_bytes: int) -> bool:
    return size > SPLIT * target_bytes and size >= 2 * group_bytes


def cut(sizes: list[int], target_bytes: int, group_bytes: int) -> list[tuple[tuple[int, int], int]]:
    """Consecutive pieces -> ([first, stop), bytes) spans of at least ``target_bytes`` (the last: the
    rest); a piece that ``splits`` is a span of its own."""
    spans, first, total = [], 0, 0
    for index, size in enumerate(sizes):
        if splits(size, target_bytes, group_bytes):
            if first < index:
                spans.append(((first, index), total))
            spans.append(((index, index + 1), size))
            first, total = index + 1, 0
            continue
        total += size
        if total >= target_bytes:
            spans.append(((first, index + 1), total))
            first, total = index + 1, 0
    return spans + [((first, len(sizes)), total)] if first < len(sizes) else spans


def row_spans(file, piece: int, size: int, target_bytes: int,
              group_bytes: int) -> list[tuple[tuple[int, int], int]]:
    """Piece ``piece`` as ([first row, stop row), estimated bytes) ranges of about ``target_bytes``
    (none of less than ``group_bytes``); [] when it is not cut."""
    if not splits(size, target_bytes, group_bytes):
        return []
    if file.kind == "parquet":
        batches = [tables.parquet_row_groups(file.url)[piece][::-1]]  # (rows, bytes): the rows spread evenly
    else:
        url = tables.arrow_data_files(file.url)[piece]
        with guarded(url, "a broken Arrow data file") as stream:
            batches = arrow_stream.batch_sizes(stream)
    parts = min(round(size / target_bytes), size // group_bytes)
    return balanced(batches, parts)


def balanced(batches: list[tuple[int, int]], parts: int) -> list[tuple[tuple[int, int], int]]:
    """Rows of consecutive (rows, bytes) batches cut into ``parts`` ranges of about equal bytes (a
    batch's rows taken as equally long), in integers: the same ranges on every machine."""
    total = sum(size for _, size in batches)
    rows_total = sum(rows for rows, _ in batches)
    cuts, row, position, j = [0], 0, 0, 1
    for rows, size in batches:
        while j < parts and parts * (position + size) > j * total:  # cut j falls in this batch
            cuts.append(row + (j * total - parts * position) * rows // (parts * size))
            j += 1
        row, position = row + rows, position + size
    cuts.append(rows_total)
    cuts = sorted(set(cuts))
    if rows_total == 0:
        return []
    return [((a, b), total * (b - a) // rows_total) for a, b in zip(cuts, cuts[1:])]
