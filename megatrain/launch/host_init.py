"""PID 1 of one host of ``megatrain/launch/hosts.py``: makes the host's own mounts and name, then reaps.

    python -S host_init.py ROLE HOSTS_FILE      (started by hosts.up inside the host's new namespaces)

Run by ``unshare --uts --mount --pid --fork --mount-proc --propagation private`` inside the host's
network namespace, so what it mounts is seen by this host only: a fresh tmpfs on ``/dev/shm`` and
``/tmp`` (no other host's shared memory or temporary files), the cluster's hosts file over
``/etc/hosts`` (every host reachable by its role's name), and the hostname ``ROLE``. It prints
``ready`` and then does what an init does: reaps the orphans re-parented to it. It ignores SIGTERM
(PID 1 of a namespace gets no signal it has no handler for); SIGKILL from outside ends the host, every
process of its PID namespace with it.

Standard library only, started with ``-S``: it is up in milliseconds.
"""

import ctypes
import os
import signal
import socket
import sys

MS_BIND = 4096


def _mount(source: str, target: str, kind: str | None, flags: int = 0, options: str = "") -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(source.encode(), target.encode(), kind.encode() if kind else None, flags, options.encode()) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mount {source} on {target}: {os.strerror(errno)}")


def main() -> None:
    role, hosts_file = sys.argv[1], sys.argv[2]
    _mount("tmpfs", "/dev/shm", "tmpfs", 0, "mode=1777,size=2g")
    _mount("tmpfs", "/tmp", "tmpfs", 0, "mode=1777,size=2g")
    _mount(hosts_file, "/etc/hosts", None, MS_BIND)
    socket.sethostname(role)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    os.close(1)
    os.close(2)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # so that pause() returns when an orphan ends
    while True:
        try:
            while True:
                os.wait()
        except ChildProcessError:
            signal.pause()


if __name__ == "__main__":
    main()
