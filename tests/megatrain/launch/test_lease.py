"""The campaign lease: one holder at a time, refused with the owner named, stale holders taken
over safely (raced by real processes), heartbeats that notice a lost lease; on a lock file and
on a real redis-server."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from dataclasses import asdict
from pathlib import Path

import pytest

from megatrain.launch.lease import FileLeaseStore, Lease, LeaseHeld, LeaseRecord, RedisLeaseStore

ROOT = Path(__file__).resolve().parents[3]

# A process that takes the lease, says so, then holds it until killed (or for HOLD_S seconds).
HOLDER = textwrap.dedent("""\
    import sys, time
    from megatrain.launch.lease import FileLeaseStore, Lease, LeaseHeld, RedisLeaseStore
    kind, where, owner, start_at, hold_s = sys.argv[1:6]
    store = FileLeaseStore(where) if kind == "file" else RedisLeaseStore(where, "race", 60)
    time.sleep(max(0.0, float(start_at) - time.time()))  # contenders start together
    try:
        lease = Lease(store, owner, stale_after_s=60, log=lambda m: None).acquire()
    except LeaseHeld as exc:
        print("HELD", exc, flush=True)
        sys.exit(0)
    print("WON", owner, flush=True)
    time.sleep(float(hold_s))
    lease.release()
""")


def start_holder(kind: str, where: str, owner: str, start_at: float = 0.0, hold_s: float = 600) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, "-c", HOLDER, kind, where, owner, str(start_at), str(hold_s)],
                            stdout=subprocess.PIPE, text=True, env=env)


def wait_line(proc: subprocess.Popen) -> str:
    line = proc.stdout.readline().strip()
    assert line, f"holder exited without a word (code {proc.wait()})"
    return line


@pytest.fixture(scope="module")
def redis_url():
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server not installed (apt-get install -y redis-server)")
    from megatrain.reliability.redis_server import start_redis_server

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = start_redis_server(port)
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture(params=["file", "redis"])
def backend(request, tmp_path):
    """(kind, where, make_store): a lock-file directory, or a Redis URL with a fresh lease name."""
    if request.param == "file":
        where = str(tmp_path / "campaign")
        return "file", where, lambda: FileLeaseStore(where)
    url = request.getfixturevalue("redis_url")
    RedisLeaseStore(url, "race", 60).client.delete("megatrain:lease:race")  # the cases share the name
    return "redis", url, lambda: RedisLeaseStore(url, "race", 60)


def test_a_second_holder_is_refused_at_once_naming_the_owner(backend):
    kind, where, make_store = backend
    holder = start_holder(kind, where, "flow run first")
    try:
        assert wait_line(holder) == "WON flow run first"
        started = time.monotonic()
        with pytest.raises(LeaseHeld) as refused:
            Lease(make_store(), "flow run second").acquire()
        assert time.monotonic() - started < 2.0
        assert "flow run first" in str(refused.value) and f"pid {holder.pid}" in str(refused.value)
        assert refused.value.holder.pid == holder.pid
    finally:
        holder.kill()
        holder.wait()


def test_a_dead_holders_lease_is_taken_over_and_released_on_exit(backend):
    kind, where, make_store = backend
    holder = start_holder(kind, where, "crashed run")
    assert wait_line(holder) == "WON crashed run"
    os.kill(holder.pid, signal.SIGKILL)  # no release: the record stays, its pid is dead
    holder.wait()
    notes: list[str] = []
    with Lease(make_store(), "new run", log=notes.append) as lease:
        assert lease.took_over is not None and lease.took_over.pid == holder.pid
        assert f"pid {holder.pid}" in notes[0] and "dead" in notes[0]
        with pytest.raises(LeaseHeld, match="new run"):
            Lease(make_store(), "third run").acquire()
    with Lease(make_store(), "third run") as third:  # released on exit: free again, nothing taken over
        assert third.took_over is None


def test_a_killed_holder_not_yet_reaped_holds_nothing(backend):
    """A SIGKILLed rank whose parent died too waits as a zombie until pid 1 reaps it: its
    /proc entry remains, but it is dead and its lease is taken over at once."""
    kind, where, make_store = backend
    holder = start_holder(kind, where, "killed, unreaped")
    assert wait_line(holder) == "WON killed, unreaped"
    os.kill(holder.pid, signal.SIGKILL)  # not waited for: a zombie until holder.wait()
    deadline = time.monotonic() + 10
    while Path(f"/proc/{holder.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.monotonic() < deadline, "the holder never became a zombie"
        time.sleep(0.05)
    try:
        with Lease(make_store(), "restarted rank", log=lambda note: None) as lease:
            assert lease.took_over is not None and lease.took_over.pid == holder.pid
    finally:
        holder.wait()


@pytest.mark.slow
def test_racing_contenders_for_a_stale_lease_have_exactly_one_winner(backend):
    kind, where, make_store = backend
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = LeaseRecord(owner="dead run", pid=dead.pid, pid_start="0")
    make_store().swap(stale, lambda current: True)
    start_at = time.time() + 3.0  # after every contender has imported
    contenders = [start_holder(kind, where, f"contender {i}", start_at=start_at, hold_s=4) for i in range(4)]
    answers = [wait_line(proc) for proc in contenders]
    for proc in contenders:
        proc.wait(timeout=60)
    winners = [a for a in answers if a.startswith("WON")]
    assert len(winners) == 1, answers
    winner = winners[0].removeprefix("WON ")
    assert all(winner in a for a in answers if a.startswith("HELD")), answers  # the losers name the winner


def test_a_lease_with_an_old_heartbeat_from_another_host_is_stale_and_a_live_one_is_not(backend):
    _, _, make_store = backend
    old = LeaseRecord(owner="run on node-7", host="node-7", pid=1, heartbeat=time.time() - 120)
    assert "heartbeat 120 s old" in old.stale_reason(60)
    fresh = LeaseRecord(owner="run on node-7", host="node-7", pid=1)
    assert fresh.stale_reason(60) is None  # another host's pid cannot be checked: the heartbeat decides
    make_store().swap(fresh, lambda current: True)
    with pytest.raises(LeaseHeld, match="node-7"):
        Lease(make_store(), "here").acquire()
    make_store().swap(old, lambda current: True)
    with Lease(make_store(), "here") as lease:
        assert lease.took_over.owner == "run on node-7"


@pytest.mark.slow
def test_the_holder_notices_a_takeover_rewrites_a_vanished_lease_and_a_waiter_gets_it_when_released(backend):
    _, _, make_store = backend
    lost: list[str] = []
    first = Lease(make_store(), "suspended run", heartbeat_s=0.1, on_lost=lost.append).acquire()
    usurper = LeaseRecord(owner="usurper")
    make_store().swap(usurper, lambda current: True)  # as a takeover after our heartbeat went stale
    deadline = time.monotonic() + 5
    while not lost and time.monotonic() < deadline:
        time.sleep(0.05)
    assert first.lost and "usurper" in lost[0]
    make_store().delete(usurper.token)
    steady = Lease(make_store(), "steady run", heartbeat_s=0.1, on_lost=lost.append).acquire()
    make_store().delete(steady.record.token)  # the store lost it (a Redis restart): not a takeover
    time.sleep(0.5)
    assert not steady.lost and make_store().swap(LeaseRecord(owner="probe"), lambda c: False)[1].token == steady.record.token
    steady.release()
    make_store().swap(usurper, lambda current: True)
    first.release()  # must not delete the usurper's lease
    assert make_store().swap(LeaseRecord(owner="probe"), lambda current: False)[1].token == usurper.token
    make_store().delete(usurper.token)

    holder = start_holder(backend[0], backend[1], "short run", hold_s=1.5)
    assert wait_line(holder) == "WON short run"
    with Lease(make_store(), "patient run", wait_s=30) as patient:  # waits, bounded, for the release
        assert patient.took_over is None
    holder.wait(timeout=30)


def test_a_torn_lease_file_does_not_block_forever(tmp_path):
    store = FileLeaseStore(tmp_path)
    store.path.write_text('{"owner": "half')
    with Lease(store, "next run") as lease:
        assert json.loads(store.path.read_text())["token"] == lease.record.token
    assert not store.path.exists()
    assert asdict(LeaseRecord.parse(json.dumps(asdict(LeaseRecord(owner=uuid.uuid4().hex)))))["pid"] == os.getpid()


def test_a_holder_stopped_inside_the_guard_costs_a_deadline_not_a_hang(tmp_path, monkeypatch):
    """The lock file's guard (an flock held for microseconds) held by a process that was then
    stopped (SIGSTOP): a contender gives up after the guard's deadline, in one line naming the
    guard file and the holder's pid, instead of waiting in flock() for as long as it stays stopped."""
    from megatrain.launch import lease as lease_module

    monkeypatch.setattr(lease_module, "GUARD_DEADLINE_S", 1.0)
    guard = tmp_path / "lease.json.guard"
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import fcntl, sys, time
        handle = open({str(guard)!r}, "a")
        fcntl.flock(handle, fcntl.LOCK_EX)
        print("held", flush=True)
        time.sleep(600)
        """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        os.kill(holder.pid, signal.SIGSTOP)
        outcome: dict = {}

        def contend() -> None:
            try:
                Lease(FileLeaseStore(tmp_path), "second").acquire()
            except Exception as exc:  # noqa: BLE001  (checked below)
                outcome["error"] = exc

        import threading

        thread = threading.Thread(target=contend, name="contender")
        thread.start()
        thread.join(30)  # the previous code stays in flock() until the holder runs again
        assert not thread.is_alive(), "the contender still waits in flock()"
        assert isinstance(outcome.get("error"), TimeoutError), outcome
        assert str(outcome["error"]) == (f"no answer from lease guard (flock) at {guard} (pid {holder.pid}) within "
                                         "1 s (its holder does not let go)")
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
        holder.stdout.close()
