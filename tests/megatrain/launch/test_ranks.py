"""The supervised launch: what a crashed job reports as its cause."""

from __future__ import annotations

from megatrain.launch.ranks import describe_root_cause, last_error, root_cause


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


# What torchrun printed when rank 1 of 2 was SIGKILLed and rank 0 then failed in gloo (trimmed).
KILLED_RANK_OUTPUT = """\
[rank0]: Traceback (most recent call last):
[rank0]:   File "/tmp/rf/killer.py", line 10, in <module>
[rank0]:     dist.all_reduce(t)
[rank0]: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:386. This is typically caused by a remote worker crashing.
W1124 09:34:56.827000 10479 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 10497 closing signal SIGTERM
E1124 09:34:56.843000 10479 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: -9) local_rank: 1 (pid: 10498) of binary: python
torch.distributed.elastic.multiprocessing.errors.ChildFailedError: 
=======================================================
/tmp/rf/killer.py FAILED
-------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-24_09:34:56
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 10497)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 10497
-------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-24_09:34:56
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 10498)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 10498
=======================================================
""".splitlines()


def test_the_root_cause_is_the_first_failed_rank_torchrun_names_not_a_peers_gloo_error():
    cause = root_cause(KILLED_RANK_OUTPUT)
    assert cause == {"rank": 1, "exitcode": -9, "signal": "SIGKILL", "error": ""}
    assert describe_root_cause(cause, step=5) == "rank 1 was killed by SIGKILL (exit code -9) in step 5"
    assert "gloo" not in describe_root_cause(cause)
    assert root_cause(["no torchrun summary here"]) is None


def test_a_rank_that_raised_is_named_with_its_own_exception():
    lines = [
        "[rank0]: RuntimeError: Connection closed by peer",
        "[rank1]: ValueError: bad value in step 3",
        "Root Cause (first observed failure):",
        "[0]:",
        "  rank      : 1 (local_rank: 1)",
        "  exitcode  : 1 (pid: 77)",
        "  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html",
        "==========",
    ]
    cause = root_cause(lines)
    assert cause == {"rank": 1, "exitcode": 1, "signal": None, "error": "ValueError: bad value in step 3"}
    assert describe_root_cause(cause, 3) == "rank 1 exited with code 1 in step 3: ValueError: bad value in step 3"
