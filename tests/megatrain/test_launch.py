"""The supervised launch: what a crashed job reports as its cause."""

from __future__ import annotations

from megatrain.launch import last_error


def test_a_crash_names_the_exception_a_rank_printed_not_torchruns_summary():
    output = [
        '[rank0]:     raise BadShardError(url, "sha256 does not match the index")',
        "[rank0]: megatrain.data.index.BadShardError: bad shard /s/shard-000080.tar: sha256 does not match the index",
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
        "  time      : 2026-11-22_03:59:44",
        "  error_file: <N/A>",
    ]
    assert last_error(output) == ("megatrain.data.index.BadShardError: bad shard /s/shard-000080.tar: "
                                  "sha256 does not match the index")
    assert last_error(["all good", "  exitcode  : -9 (pid: 12)"]) == ""
