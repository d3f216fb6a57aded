"""The documents of Parquet files and ``datasets`` Arrow folders (column reads, row ranges).

``source_formats.identify`` tells these files by their bytes; here they are read: a Parquet file
row group by row group, only the text column, an Arrow folder (``Dataset.save_to_disk``) data
file by data file, and a cut piece of either by its rows. The text column may be ``string``,
``large_string``, ``string_view`` or a dictionary of those (pandas' categorical). pyarrow is
imported only when one of these is read. Failures are one DataError naming the file, as in
``source_formats``; storage failures stay StorageErrors.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from typing import Any

from megatrain import storage
from megatrain.data.index import DataError
from megatrain.data.source_formats import CHUNK, Guarded, broken, guarded, read_range
from megatrain.storage.urls import describe


def parquet_row_groups(url: str, text_field: str | None = None) -> list[tuple[int, int]]:
    """(compressed bytes, rows) of each row group, from the footer alone (and the text column checked)."""
    import pyarrow.parquet as pq

    with Guarded(url) as raw, broken(url, "a broken Parquet footer"):
        meta = pq.ParquetFile(raw).metadata
        schema = meta.schema.to_arrow_schema()
        sizes = [(sum(group.column(c).total_compressed_size for c in range(group.num_columns)), group.num_rows)
                 for group in map(meta.row_group, range(meta.num_row_groups))]
    if text_field is not None:
        check_column(url, schema, text_field)
    return sizes


def check_column(url: str, schema: Any, text_field: str) -> None:
    """A DataError listing the columns unless ``text_field`` is a string column of ``schema``."""
    import pyarrow as pa

    columns = ", ".join(f"{f.name} ({f.type})" for f in schema)
    if text_field not in schema.names:
        raise DataError(f"{url}: no column {text_field!r} (data.text_field); its columns: {columns}")
    declared = kind = schema.field(text_field).type
    if pa.types.is_dictionary(kind):  # pandas' categorical, a writer's dictionary encoding: the values are the text
        kind = kind.value_type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)):
        raise DataError(f"{url}: column {text_field!r} holds {declared}, not strings; its columns: {columns}")


def parquet_documents(url: str, text_field: str, groups: tuple[int, int] | None = None,
                      rows: tuple[int, int] | None = None) -> Iterator[str]:
    """The non-empty strings of the text column, one row group at a time, only that column read;
    with ``rows``, only those rows of the one row group in ``groups``."""
    import pyarrow.parquet as pq

    with Guarded(url) as raw:
        with broken(url, "a broken Parquet footer"):
            parquet = pq.ParquetFile(raw, page_checksum_verification=True)  # where the writer stored CRCs
        check_column(url, parquet.schema_arrow, text_field)
        for group in range(*(groups or (0, parquet.num_row_groups))):
            with broken(url, f"a broken Parquet row group {group}"):
                column = parquet.read_row_group(group, columns=[text_field]).column(0)
            if rows is not None:
                column = column.slice(rows[0], rows[1] - rows[0])
            yield from _strings(column.chunks)


def arrow_data_files(folder: str) -> list[str]:
    """The data files of a ``datasets`` save_to_disk folder, in order; every name read from
    state.json stays inside the folder (storage.confined)."""
    state_url = storage.join_url(folder, "state.json")
    try:
        state = json.loads(storage.read_bytes(state_url))
        entries = state["_data_files"]
        names = [entry["filename"] for entry in entries]
    except (ValueError, KeyError, TypeError) as exc:
        raise DataError(f"{folder}: an Arrow dataset folder whose state.json has no _data_files list "
                        f"of filenames ({describe(exc)})") from exc
    return [storage.confined(folder, name, state_url) for name in names]


def arrow_data_info(url: str) -> dict[str, Any]:
    """storage.info of one Arrow data file, which must exist and start as an IPC stream does."""
    if not storage.exists(url):
        raise DataError(f"{url}: an Arrow data file named in state.json does not exist")
    head = read_range(url, 0, 4)
    if head != b"\xff\xff\xff\xff":
        raise DataError(f"{url}: not an Arrow IPC stream (it starts with {head!r}), as datasets writes them")
    return storage.info(url)


def check_arrow_features(folder: str, text_field: str) -> None:
    """The text column, checked in dataset_info.json's features (metadata: no data file read)."""
    info_url = storage.join_url(folder, "dataset_info.json")
    try:
        features = json.loads(storage.read_bytes(info_url)).get("features")
    except (ValueError, AttributeError) as exc:
        raise DataError(f"{info_url}: not a JSON object ({describe(exc)})") from exc
    if not isinstance(features, dict):
        return  # no features recorded: the data file's schema is checked when it is read
    columns = ", ".join(features)
    feature = features.get(text_field)
    if feature is None:
        raise DataError(f"{folder}: no column {text_field!r} (data.text_field); its columns: {columns}")
    if not (isinstance(feature, dict) and feature.get("dtype") in ("string", "large_string")):
        raise DataError(f"{folder}: column {text_field!r} holds {feature}, not strings; its columns: {columns}")


def arrow_documents(data_urls: list[str], text_field: str) -> Iterator[str]:
    """The non-empty strings of the text column of each Arrow IPC stream, batch by batch."""
    import pyarrow as pa

    for url in data_urls:
        with Guarded(url) as raw, broken(url, "a broken Arrow data file"):
            reader = pa.ipc.open_stream(io.BufferedReader(raw, CHUNK))
            check_column(url, reader.schema, text_field)
            index = reader.schema.get_field_index(text_field)
            for batch in reader:
                yield from _strings([batch.column(index)])


def arrow_rows(url: str, text_field: str, rows: tuple[int, int]) -> Iterator[str]:
    """The non-empty strings of the text column in rows [first, stop) of one Arrow IPC stream;
    only the record batches holding them are read (``arrow_stream.py``)."""
    from megatrain.data import arrow_stream

    with guarded(url, "a broken Arrow data file") as stream:
        for batch in arrow_stream.read_rows(stream, *rows):
            check_column(url, batch.schema, text_field)
            yield from _strings([batch.column(batch.schema.get_field_index(text_field))])


def _strings(arrays: Any) -> Iterator[str]:
    for array in arrays:
        yield from filter(None, array.to_pylist())  # nulls and empty strings are no documents
