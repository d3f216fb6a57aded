"""Files by URL: every read and write of shards and checkpoints goes through this package.

A URL is a plain path, ``file://``, ``memory://``, ``s3://bucket/key``, ``webhdfs://host:port/path``
or ``hdfs://host[:port]/path``. ``hdfs://`` is served by fsspec's WebHDFS REST client (the HDFS
HTTP gateway every namenode runs), because fsspec's native ``hdfs://`` needs a JVM and Hadoop jars.

Credentials never live in code or configs; they come from the environment:

=============================  =====================================================================
``MEGATRAIN_S3_ENDPOINT``      S3-compatible endpoint (else ``AWS_ENDPOINT_URL_S3``/``AWS_ENDPOINT_URL``);
                               keys and region come from botocore's usual ``AWS_*`` variables/files
``MEGATRAIN_HDFS_USER``        WebHDFS ``user.name`` (else ``HADOOP_USER_NAME``; a ``user@`` in the
                               URL wins)
``MEGATRAIN_HDFS_NAMENODE``    ``host[:port]`` for ``hdfs:///path`` URLs that name no host
``MEGATRAIN_WEBHDFS_PORT``     namenode HTTP port when an ``hdfs://`` URL has none (default 9870)
``MEGATRAIN_WEBHDFS_HTTPS``    ``1`` to speak HTTPS to the namenode
``MEGATRAIN_WEBHDFS_TOKEN``    a Hadoop delegation token (replaces the user name)
=============================  =====================================================================

fsspec's own configuration (``FSSPEC_<PROTOCOL>_<OPTION>`` variables, ``~/.config/fsspec``) applies
too, and explicit ``options`` passed to :func:`resolve` override everything.

Every failure is a :class:`StorageError` whose message starts with the URL, so a bad path in a
config is found from the log line alone.

Modules: ``urls`` (URL -> filesystem; reads, listings, deletes), ``atomic`` (writes that appear
whole or not at all), ``space`` (free space before a write), ``confine`` (names read from metadata
stay inside their folder), ``probe`` (is a location writable and big enough, before a run needs it).
Callers use the package: ``from megatrain import storage``.
"""

from megatrain.storage.atomic import atomic_write, put_file, write_bytes
from megatrain.storage.confine import confined
from megatrain.storage.probe import (
    LocationNotWritable,
    LocationTooSmall,
    ProbeResult,
    Target,
    probe_location,
    probe_locations,
)
from megatrain.storage.space import NoSpaceError, check_space, free_bytes, is_no_space
from megatrain.storage.urls import (
    StorageError,
    exists,
    find,
    glob,
    info,
    join_url,
    list,
    listdir,
    local_path,
    makedirs,
    open_url,
    parent_url,
    read_bytes,
    resolve,
    rm,
    size,
)

__all__ = [
    "LocationNotWritable", "LocationTooSmall", "NoSpaceError", "ProbeResult", "StorageError", "Target",
    "atomic_write", "check_space", "confined", "exists", "find", "free_bytes", "glob", "info", "is_no_space",
    "join_url", "list", "listdir", "local_path", "makedirs", "open_url", "parent_url", "probe_location", "probe_locations",
    "put_file", "read_bytes", "resolve", "rm", "size", "write_bytes",
]
