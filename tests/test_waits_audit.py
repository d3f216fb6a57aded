"""Every blocking call of the flow and the ranks is bounded, or listed here with the reason it may block.

A wait on another process without a deadline is a hang no watchdog sees (a keeper stopped with
SIGSTOP kept a restore in recv() for 602.9 s). This reads every module of megatrain/, flows/ and
tasks/ and finds the calls that block until another party acts and take no timeout: ``.wait()``,
``.join()``, ``.result()`` and ``.communicate()`` without arguments, every ``recv``/``recvmsg`` (a
socket's bound is its settimeout, which a reader cannot see at the call) and every blocking
``flock``. Each must be in ALLOWED with the reason it is bounded, or it fails the test; an entry
that no longer matches a call fails it too, so the list stays the audit of what there is.
New waits on other processes go through ``megatrain/waits.py`` (a deadline, a line naming what
and where, and the heartbeat).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NO_TIMEOUT = {"wait", "join", "result", "communicate"}  # blocking when called without arguments
SOCKET_READS = {"recv", "recvmsg"}

COLLECTIVE = "a collective's handle: bounded by the process group's timeout, and the rank's heartbeat says collective (the watcher's stall rule)"
OWN_THREAD = "a future of this process's own worker thread (hashing, staging to local disk): no other process involved"
REAPED = "reaping a child after SIGKILL: the kernel ends it"
FINAL_STATE = "result() of a Prefect State that is final already (return_state=True): no wait"

ALLOWED: dict[tuple[str, str], str] = {
    ("megatrain/launch/host_init.py", "os.wait()"):
        "PID 1 of a host reaps its orphans for as long as the host lives; SIGKILL from outside ends it",
    ("megatrain/checkpoint/files.py", "hashed.result()"): OWN_THREAD,
    ("megatrain/checkpoint/keeper_wire.py", "future.result()"): OWN_THREAD,
    ("megatrain/checkpoint/memory.py", "future.result()"): OWN_THREAD,
    ("megatrain/checkpoint/snapshot.py", "self.wait()"): OWN_THREAD + " (the previous staging)",
    ("megatrain/checkpoint/snapshot.py", "pending.result()"): OWN_THREAD + " (the previous staging)",
    ("megatrain/checkpoint/manager.py", "staged_future.result()"): OWN_THREAD + " (the upload job waits for its staging)",
    ("megatrain/checkpoint/manager.py", "job.result()"):
        "the rank's upload jobs at close: each storage call is bounded by the client's timeouts and retried "
        "upload_retries times with backoff; the commit waits commit_timeout_s",
    ("megatrain/checkpoint/memory.py", "self.wait()"): "the keeper's seal: a request bounded by SEAL_DEADLINE_S",
    ("megatrain/checkpoint/memory.py", "pending.result()"): "the keeper's seal: a request bounded by SEAL_DEADLINE_S",
    ("megatrain/checkpoint/keeper_wire.py", "sock.recvmsg(_HEADER.size - len(header), socket.CMSG_SPACE(4 * 16))"):
        "recv_message: bounded by until= (the keeper client's deadline) or the socket's timeout (peer channels "
        "60 s, the keeper's server connections wait for their rank by design and end with it)",
    ("megatrain/checkpoint/keeper_wire.py", "sock.recv(min(size - len(payload), 1 << 20))"):
        "recv_message: as above",
    ("megatrain/checkpoint/keeper_peer.py", "channel.recv()"):
        "a peer keeper's TCP channel: settimeout 60 s (client) / SERVE_TIMEOUT_S 120 s (server)",
    ("megatrain/checkpoint/keeper_peer.py", "self.wake.wait()"):
        "the keeper's sender thread waits for a sealed copy to send: work of its own process",
    ("megatrain/data/loader.py", "self.thread.join()"):
        "the prefetch thread must finish before the shard cache is reused (loader.close); a storage read that "
        "hangs shows as phase data in the heartbeat and is ended by heartbeat_timeout_s",
    ("megatrain/data/local_engine.py", "future.result()"): "as_completed() hands over finished futures: no wait",
    ("megatrain/data/node_loader.py", "self.producer.join()"): "the node loader's own producer thread, told to stop",
    ("megatrain/data/node_loader.py", "conn.recv()"):
        "local rank 0 reads its ranks' acks and hellos: start-up is bounded by _accept's timeout, and a rank "
        "gone closes its connection (EOF)",
    ("megatrain/data/node_loader.py", "self.conn.recv()"):
        "a local rank waits for rank 0's window: phase data in its heartbeat, ended by heartbeat_timeout_s "
        "(at start-up: init_timeout_s)",
    ("megatrain/launch/nodes.py", "proc.wait()"): REAPED,
    ("megatrain/reliability/selfcheck.py", "proc.wait()"): REAPED,
    ("tasks/keepers.py", "proc.wait()"): REAPED,
    ("megatrain/parallel/expert_parallel.py", "ctx.flight.work.wait()"): COLLECTIVE,
    ("megatrain/parallel/expert_parallel.py", "flight.work.wait()"): COLLECTIVE,
    ("megatrain/parallel/overlap.py", "work.wait()"): COLLECTIVE,
    ("megatrain/parallel/ring_attention.py", "request.wait()"): COLLECTIVE,
    ("megatrain/parallel/overlap.py", "bucket.work.wait()"): COLLECTIVE,
    ("flows/lifecycle.py", "state.result()"): FINAL_STATE,
    ("flows/pretrain.py", "validated.result()"): FINAL_STATE,
    ("flows/pretrain.py", "state.result()"): FINAL_STATE,
    ("tasks/_retry.py", "state.result()"): FINAL_STATE + " (a retry condition reads the failed state)",
    ("tasks/data.py", "state.result()"): FINAL_STATE + " (a retry condition reads the failed state)",
}


def blocks(node: ast.AST) -> bool:
    """A call that may wait for another party with no bound of its own."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
        return False
    name, text = node.func.attr, ast.unparse(node)
    return ((name in NO_TIMEOUT and not node.args and not node.keywords) or name in SOCKET_READS
            or (name == "flock" and "LOCK_NB" not in text and "LOCK_UN" not in text))


def blocking_calls() -> dict[tuple[str, str], list[int]]:
    found: dict[tuple[str, str], list[int]] = {}
    for top in ("megatrain", "flows", "tasks"):
        for path in sorted((ROOT / top).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if blocks(node):
                    found.setdefault((str(path.relative_to(ROOT)), ast.unparse(node)), []).append(node.lineno)
    return found


def test_every_blocking_call_is_bounded_or_listed_with_its_reason():
    found = blocking_calls()
    unlisted = [f"{path}:{lines[0]}: {call}" for (path, call), lines in sorted(found.items()) if (path, call) not in ALLOWED]
    assert not unlisted, ("calls that may wait without a deadline (bound them with megatrain/waits.py, or list them "
                          "in ALLOWED with the reason they are bounded):\n" + "\n".join(unlisted))
    stale = [f"{path}: {call}" for path, call in ALLOWED if (path, call) not in found and (ROOT / path).exists()]
    assert not stale, "ALLOWED entries that match no call any more:\n" + "\n".join(stale)


def test_the_audit_finds_what_it_looks_for():
    """The scanner reports the lease guard's old blocking flock, a join without a timeout and a
    socket read; not a join of strings, a bounded result() or a non-blocking flock."""
    tree = ast.parse("fcntl.flock(handle, fcntl.LOCK_EX)\nt.join()\n','.join(x)\nf.result(timeout=3)\n"
                     "fcntl.flock(h, fcntl.LOCK_EX | fcntl.LOCK_NB)\nsock.recv(4)\n")
    found = [ast.unparse(node) for node in ast.walk(tree) if blocks(node)]
    assert found == ["fcntl.flock(handle, fcntl.LOCK_EX)", "t.join()", "sock.recv(4)"]
