"""Stage 2: staged files -> durable storage, each verified, then one atomic commit.

``upload_checkpoint(staged_dir, durable_url)`` copies the files of one staged step to
``<durable_url>/step-XXXXXXXX/``:

1. for every rank whose marker (``rank-XXXXX.done.json``) is in the staged dir, or the ranks asked
   for: upload each of its files, then read the file back and compare size and sha256 with what
   staging recorded; a failure of any kind (storage error, mismatch) is retried with exponential
   backoff. A file already in place with the right checksum is skipped, so a re-run (a Prefect
   task retry) only finishes what is missing;
2. upload the rank's marker, which says "this rank's files are durable and verified";
3. commit (``commit=True``): wait until the markers of all ``world_size`` ranks are durable, then
   write ``manifest.json`` atomically (temporary name, then rename). Restore ignores any step
   without a manifest, so a crash anywhere before this point leaves a step that is never used.

With a ``fence`` (``launch/fencing.py``: the attempt's epoch, on a cluster whose launcher issued
one) every file and marker upload first checks that no newer epoch exists, the markers and the
manifest carry the epoch, and the commit is a compare-and-record in the run's Redis before the
manifest is written: a fenced attempt's rank uploads and commits nothing (``StaleEpoch``).

Who uploads what. On a cluster the staging dir is a node-local disk that rank 0 cannot read, so in
the trainer's "thread" mode every rank uploads its own files in a background thread (the nodes'
upload bandwidth adds up) and rank 0 commits once every rank's marker is durable. This needs no
collective: a collective from a background thread would interleave with the training loop's own.
The Prefect flow ("external" mode) calls this function as its own task with all ranks of a
shared staging dir (one node), after the trainer has written ``staged.json`` there.
"""

from __future__ import annotations

import datetime
import json
import logging
import shutil
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

from megatrain import storage
from megatrain.checkpoint import catalog
from megatrain.checkpoint.files import (
    FORMAT_VERSION, MANIFEST, REPLACING, STAGED, ChecksumError, FileRecord, parse_step, rank_marker, sha256_stream,
    step_dir_name, write_json,
)

log = logging.getLogger("megatrain.checkpoint")
T = TypeVar("T")


class UploadError(RuntimeError):
    """An upload or a commit gave up; the step stays uncommitted and is never restored."""


@dataclass
class UploadResult:
    step: int
    url: str
    committed: bool
    bytes: int  # bytes uploaded by this call (files already in place are not counted)
    seconds: float


def with_retries(action: Callable[[], T], what: str, retries: int, backoff_s: float, max_backoff_s: float = 60.0) -> T:
    """Run ``action``; on OSError (StorageError is one) or ChecksumError wait backoff_s * 2**attempt
    (at most max_backoff_s) and try again, ``retries`` times."""
    for attempt in range(retries + 1):
        try:
            return action()
        except (OSError, ChecksumError) as exc:
            if attempt == retries:
                raise UploadError(f"{what}: gave up after {retries + 1} attempts: {exc}") from exc
            delay = min(max_backoff_s, backoff_s * 2**attempt)
            log.warning("%s failed (%s); retry %d/%d in %.1f s", what, exc, attempt + 1, retries, delay)
            time.sleep(delay)
    raise AssertionError("unreachable")


def verify_remote(url: str, record: FileRecord) -> None:
    """Raise ChecksumError unless the durable file at ``url`` has the recorded size and sha256."""
    size = storage.size(url)  # cheap; catches a truncated upload without reading it
    if size != record.size:
        raise ChecksumError(f"{url}: size {size} != staged {record.size}")
    with storage.open_url(url) as handle:
        actual = sha256_stream(handle)
    if actual != record:
        raise ChecksumError(f"{url}: sha256 {actual.sha256[:16]}... != staged {record.sha256[:16]}...")


def replace_if_corrupt(durable_url: str, step: int) -> list[str]:
    """A step staged again (a later attempt redid it) but already committed: keep the committed
    copy if it verifies; if it does not, un-commit it and empty it, so that the upload writes the
    staged copy into a clean folder in one go. Returns the problems found (none: it stands).

    Emptying comes first: whatever the step holds (a damaged file, a planted symlink, a leftover)
    is removed as a link or a file, never followed, so nothing in it can make the new upload fail
    or read from outside. The REPLACING file, written after, tells whoever commits to re-check
    every file against the markers."""
    from megatrain.checkpoint.restore import verify_checkpoint

    step_url = storage.join_url(durable_url, step_dir_name(step))
    try:
        manifest = catalog.read_manifest(step_url)
        problems = verify_checkpoint(step_url, manifest) if manifest is not None else []
    except ValueError as exc:  # unreadable or unsafe manifest: the step is not usable as it is
        problems = [str(exc)]
    if problems:
        log.warning("committed step %d at %s does not verify (%s); replacing it with the staged copy",
                    step, step_url, "; ".join(problems))
        storage.rm(storage.join_url(step_url, MANIFEST), missing_ok=True)  # un-committed first: readers skip it
        _empty(step_url)
        storage.write_bytes(storage.join_url(step_url, REPLACING), json.dumps({"problems": problems}).encode())
    return problems


def _empty(step_url: str) -> None:
    """Remove everything below a step folder: links as links (never followed), files, folders.
    Another uploader may have emptied it first: what is already gone is fine."""
    local = storage.local_path(step_url)
    if local is None:  # object stores and HDFS have no links to follow
        for url in storage.listdir(step_url) if storage.exists(step_url) else []:
            storage.rm(url, recursive=True, missing_ok=True)
        return
    folder = Path(local)
    if folder.is_symlink():  # the step folder itself planted as a link: drop the link, make a real folder
        folder.unlink()
    for entry in list(folder.iterdir()) if folder.is_dir() else []:
        if entry.is_symlink() or not entry.is_dir():
            entry.unlink(missing_ok=True)
        else:
            shutil.rmtree(entry, ignore_errors=True)


def _files_match_markers(step_url: str, markers: dict[int, dict[str, Any]]) -> list[str]:
    """Every file the markers list, re-read and checked against them; returns the problems."""
    problems = []
    for rank, marker in sorted(markers.items()):
        for name, record in sorted(marker["files"].items()):
            url = storage.join_url(step_url, name)
            try:
                verify_remote(url, FileRecord(**record))
            except (OSError, ChecksumError) as exc:
                problems.append(f"rank {rank}: {exc}")
    return problems


def _upload_file(local: Path, url: str, record: FileRecord) -> int:
    """Upload one file unless it is already there intact; returns the bytes sent."""
    if storage.exists(url):
        try:
            verify_remote(url, record)
            return 0
        except ChecksumError:
            pass  # a leftover of an earlier attempt: replace it
    storage.put_file(str(local), url)
    verify_remote(url, record)
    return record.size


def read_staged_markers(staged_dir: Path, ranks: Iterable[int] | None = None) -> dict[int, dict[str, Any]]:
    """rank -> its done marker in a staged step dir (all present ranks when ``ranks`` is None)."""
    if ranks is None:
        paths = sorted(staged_dir.glob("rank-*.done.json"))
    else:
        paths = [staged_dir / rank_marker(r) for r in ranks]
        missing = [p.name for p in paths if not p.exists()]
        if missing:
            raise UploadError(f"{staged_dir}: not staged yet: {', '.join(missing)}")
    if not paths:
        raise UploadError(f"{staged_dir}: no rank has staged here (no rank-*.done.json)")
    markers = {}
    for path in paths:
        try:
            marker = json.loads(path.read_text())
            rank = int(marker["rank"])
            files = marker["files"]
        except (ValueError, KeyError, TypeError) as exc:
            raise UploadError(f"{path}: not a readable rank marker ({type(exc).__name__}: {exc})") from None
        if path.name != rank_marker(rank) or not isinstance(files, dict):
            raise UploadError(f"{path}: marker of rank {rank} under the wrong name, or without a files mapping")
        for name in files:  # refuse the whole marker before anything is read or written
            storage.confined(str(staged_dir), name, str(path))
        markers[rank] = marker
    return markers


def build_manifest(markers: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The commit record, from every rank's marker; the markers must agree on the run."""
    first = markers[min(markers)]
    for rank, marker in markers.items():
        if not isinstance(marker.get("files"), dict):
            raise UploadError(f"rank {rank}'s durable marker has no files mapping")
        for key in ("step", "fingerprint", "layout", "epoch"):
            if marker.get(key) != first.get(key):
                raise UploadError(f"rank {rank} staged {key}={marker[key]!r}, rank {min(markers)} {first[key]!r}")
    files = {f"rank-{rank:05d}": markers[rank]["files"] for rank in sorted(markers)}
    now = time.time()
    return {
        "format": FORMAT_VERSION,
        "step": first["step"],
        **({"epoch": first["epoch"]} if first.get("epoch") is not None else {}),  # the attempt that committed
        "layout": first["layout"],
        "fingerprint": first["fingerprint"],
        # Loader state per data-parallel rank (each DP rank reads its own slice of the data).
        "data_position": {str(m["coords"]["dp"]): m.get("data_position") for m in markers.values()
                          if m["coords"]["tp"] == 0 and m["coords"]["pp"] == 0},
        "versions": first.get("versions", {}),
        "committed_at": now,
        "committed_at_utc": datetime.datetime.fromtimestamp(now, datetime.UTC).isoformat(timespec="seconds"),
        "files": files,
        "bytes": sum(record["size"] for rank_files in files.values() for record in rank_files.values()),
    }


def _read_markers(step_url: str, ranks: Iterable[int]) -> dict[int, dict[str, Any]]:
    """The durable markers of ``ranks`` that exist, each file name in them confined to the step."""
    present = {url.rsplit("/", 1)[-1] for url in storage.listdir(step_url)}
    markers = {}
    for rank in ranks:
        if rank_marker(rank) in present:
            marker_url = storage.join_url(step_url, rank_marker(rank))
            markers[rank] = json.loads(storage.read_bytes(marker_url))
            for name in markers[rank].get("files", {}):  # the manifest will vouch for these names
                storage.confined(step_url, name, marker_url)
    return markers


def commit_checkpoint(step_url: str, world_size: int, timeout_s: float = 600.0, poll_s: float = 0.5,
                      retries: int = 5, backoff_s: float = 1.0, max_backoff_s: float = 60.0,
                      fence=None) -> dict[str, Any]:
    """Wait until every rank's marker is durable, then write the manifest (the commit).

    When the step is replacing a corrupt committed copy (``replace_if_corrupt`` left REPLACING),
    the markers of that copy may still be in place while ranks replace their files: then every
    file is also re-read and must match its (re-read) marker before the commit."""
    markers: dict[int, dict[str, Any]] = {}
    replacing_url = storage.join_url(step_url, REPLACING)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            markers.update(_read_markers(step_url, set(range(world_size)) - set(markers)))
            waiting_for = f"ranks {sorted(set(range(world_size)) - set(markers))[:8]} did not upload"
            if len(markers) == world_size and storage.exists(replacing_url):
                markers = _read_markers(step_url, range(world_size))  # re-read: ranks rewrite theirs
                problems = _files_match_markers(step_url, markers)
                waiting_for = "files still differ from their markers: " + "; ".join(problems)
                if len(markers) == world_size and not problems:
                    break
            elif len(markers) == world_size:
                break
        except OSError as exc:  # storage down or the directory not there yet: keep waiting
            waiting_for = f"storage: {exc}"
        if time.monotonic() > deadline:
            raise UploadError(f"{step_url}: {waiting_for} within {timeout_s:.0f} s; not committed")
        time.sleep(poll_s)
    manifest = build_manifest(markers)
    if fence is not None:  # the commit point: compared with the newest epoch and logged in one script
        if manifest.get("epoch") != fence.epoch:
            raise UploadError(f"{step_url}: the markers carry epoch {manifest.get('epoch')}, this committer "
                              f"{fence.epoch}; not committed")
        record = with_retries(lambda: fence.commit(manifest["step"], world_size=world_size), f"commit {step_url}",
                              retries, backoff_s, max_backoff_s)
        manifest["committed_at"] = record["time"]
    data = json.dumps(manifest, indent=1, sort_keys=True).encode()
    # storage.write_bytes writes a temporary name and renames it (an object store publishes a PUT
    # only when complete): a manifest is either whole or absent.
    url = storage.join_url(step_url, MANIFEST)
    with_retries(lambda: storage.write_bytes(url, data), f"commit {url}", retries, backoff_s, max_backoff_s)
    storage.rm(replacing_url, missing_ok=True)
    log.info("committed checkpoint %s (%.2f GB, %d ranks)", step_url, manifest["bytes"] / 1e9, world_size)
    return manifest


def upload_checkpoint(
    staged_dir: str | Path, durable_url: str, *, ranks: Iterable[int] | None = None, commit: bool = True,
    retries: int = 5, backoff_s: float = 1.0, max_backoff_s: float = 60.0, commit_timeout_s: float = 600.0,
    poll_s: float = 0.5, clean_staged: bool = False, fence=None,
) -> UploadResult:
    """Upload a staged step (all its ranks, or ``ranks``) and, with ``commit``, commit it.

    Raises UploadError when retries are exhausted or the commit times out; the step then stays
    uncommitted and a later re-run resumes where this one stopped.
    """
    start = time.perf_counter()
    staged_dir = Path(staged_dir)
    step = parse_step(staged_dir.name)
    if step is None:
        raise ValueError(f"{staged_dir}: not a staged step directory (step-XXXXXXXX)")
    step_url = storage.join_url(durable_url, step_dir_name(step))
    manifest_url = storage.join_url(step_url, MANIFEST)
    retry = dict(retries=retries, backoff_s=backoff_s, max_backoff_s=max_backoff_s)
    if (with_retries(lambda: storage.exists(manifest_url), f"check {manifest_url}", **retry)
            and not replace_if_corrupt(durable_url, step)):
        log.info("%s is already committed (and verifies)", step_url)
        if clean_staged:
            shutil.rmtree(staged_dir, ignore_errors=True)
        return UploadResult(step, step_url, True, 0, time.perf_counter() - start)

    try:
        sent, markers = _upload_ranks(staged_dir, step_url, step, ranks, retry, fence)
    except MemoryError as exc:
        # Host memory ran out mid-upload: not a step to resume later from half its files. What this
        # call wrote is removed (the step is not committed), and the cause is said in one line.
        if not storage.exists(manifest_url):
            storage.rm(step_url, recursive=True, missing_ok=True)
        raise UploadError(f"{step_url}: out of host memory while uploading step {step}; the uncommitted "
                          "step was removed, the staged copy is kept for the next try") from exc
    seconds = time.perf_counter() - start
    log.info("uploaded step %d, ranks %s: %.2f GB in %.1f s (%.0f MB/s)", step, sorted(markers), sent / 1e9,
             seconds, sent / 1e6 / max(seconds, 1e-9))

    committed = False
    if commit:
        world_size = int(markers[min(markers)]["layout"]["world_size"])
        commit_checkpoint(step_url, world_size, commit_timeout_s, poll_s, **retry, fence=fence)
        committed = True
        if clean_staged:
            shutil.rmtree(staged_dir, ignore_errors=True)
    return UploadResult(step, step_url, committed, sent, time.perf_counter() - start)


def _upload_ranks(staged_dir: Path, step_url: str, step: int, ranks: Iterable[int] | None,
                  retry: dict[str, Any], fence=None) -> tuple[int, dict[int, dict[str, Any]]]:
    """Every staged file of ``ranks`` (all: None) and then its rank's marker; returns (bytes sent, markers)."""
    sent = 0
    markers = read_staged_markers(staged_dir, ranks)
    for rank, marker in sorted(markers.items()):
        source = str(staged_dir / rank_marker(rank))
        targets = {name: (Path(storage.confined(str(staged_dir), name, source)), storage.confined(step_url, name, source),
                          FileRecord(**record)) for name, record in sorted(marker["files"].items())}
        missing = sum(record.size for _, url, record in targets.values() if not storage.exists(url))
        storage.check_space(step_url, missing, f"rank {rank}'s files of step {step}")
        for local, url, record in targets.values():
            sent += with_retries(lambda: _fenced(fence, step, lambda: _upload_file(local, url, record)),
                                 f"upload {url}", **retry)
        marker_url = storage.join_url(step_url, rank_marker(rank))
        marker_bytes = (staged_dir / rank_marker(rank)).read_bytes()
        with_retries(lambda: _fenced(fence, step, lambda: storage.write_bytes(marker_url, marker_bytes)),
                     f"upload {marker_url}", **retry)
    return sent, markers


def _fenced(fence, step: int, write: Callable[[], T]) -> T:
    """``write`` after the fence's check (none: at once); the check's outage is retried like the write's."""
    if fence is not None:
        fence.check("upload", step=step)
    return write()


def mark_staged(step_dir: Path, world_size: int, timeout_s: float = 600.0, poll_s: float = 0.2) -> bool:
    """External mode: once every rank's marker is in a (shared) staging dir, write ``staged.json``,
    the flow's signal that this step can be uploaded. Returns False on timeout."""
    deadline = time.monotonic() + timeout_s
    while not all((step_dir / rank_marker(r)).exists() for r in range(world_size)):
        if time.monotonic() > deadline:
            log.error("%s: not every rank staged within %.0f s; no staged.json", step_dir, timeout_s)
            return False
        time.sleep(poll_s)
    write_json(step_dir / STAGED, {"step": parse_step(step_dir.name), "world_size": world_size, "staged_at": time.time()})
    return True


def find_staged(staging_dir: str | Path) -> list[Path]:
    """External mode: staged step dirs ready to upload (with ``staged.json``), oldest first."""
    root = Path(staging_dir)
    if not root.is_dir():
        return []
    ready = [p for p in root.iterdir() if parse_step(p.name) is not None and (p / STAGED).exists()]
    return sorted(ready, key=lambda p: parse_step(p.name))


def ready_steps(staging_dir: str | Path) -> list[int]:
    """External mode: the steps of ``find_staged``, as numbers."""
    return [parse_step(path.name) for path in find_staged(staging_dir)]


def upload_staged_step(staging_dir: str | Path, durable_url: str, step: int, **options: Any) -> dict[str, Any]:
    """External mode, one step: upload and commit every rank's staged files, then free the staging
    space. ``options`` are those of ``upload_checkpoint`` (retries, backoff_s, ...)."""
    options.setdefault("clean_staged", True)
    staged = Path(staging_dir) / step_dir_name(step)
    return asdict(upload_checkpoint(staged, durable_url, **options))
