"""The keeper's peer tier: each node's keeper replicates its ranks' sealed copies to one other node's.

Why: the keeper survives its ranks, not its node. When a node is lost (its ranks and its keeper),
its ranks' RAM copies would be gone, and the restart would redo every step since the last durable
commit. So, as NVRx and Gemini do, every keeper sends each newly sealed copy to the keeper of the
next node in a ring (node i -> node (i + 1) % nnodes), which holds it in memfd slots of its own (two
per rank, the same spare-slot rule as local copies). A restarted rank whose own keeper holds
nothing fetches its copy from that peer over TCP (memory.py's restore: local keeper -> peer -> durable).

Replication runs in a thread of the keeper, after the seal: the training thread never waits for
the network. Only the newest sealed copy of a rank is sent; one sealed while an older one is still
queued supersedes it. A copy the rank rewrites while it is being sent fails the receiver's
checksums and is dropped there (the receiver's newest replica stays): nothing is locked against
the training loop.

Finding each other: every keeper listens on a TCP port and registers ``host:port`` under its node id
in the run's registry: a folder (``<run_dir>/keepers``, shared by nodes on one box or on a shared
file system) or the run's Redis (a hash per run, in the run token's namespace, through
``launch.redis_client.connect``).

Trust: only processes holding the run's token (``MEGATRAIN_RUN_TOKEN``, inherited from the
launcher) may push or pull copies. A connection starts with a mutual HMAC challenge (each side
proves it holds the token over both sides' nonces), and every JSON message after it carries an
HMAC under a session key with a sequence number, so headers cannot be forged, replayed or
reordered. The copy's bytes are bound by the chunk sha256s of that authenticated header, and
checked on receipt and again by the rank at restore. Without a token, the peer tier stays off:
a peer could not tell our copies from anyone else's.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from megatrain.checkpoint.keeper_wire import (
    CONNECT_TIMEOUT_S,
    READ_TIMEOUT_S,
    Channel,
    PeerError,
    Registry,
    Slot,
    chunk_hashes,
    spare_slot,
    text_hash,
)
from megatrain.checkpoint.serve_thread import serve_in_thread
from megatrain.waits import waiting

log = logging.getLogger("megatrain.keeper")

__all__ = ["HOST_ENV", "Channel", "PeerClient", "PeerError", "PeerTier", "Registry"]  # wire names, re-exported

HOST_ENV = "MEGATRAIN_KEEPER_HOST"  # the address keepers bind and advertise (default 127.0.0.1; a pod's own IP)
SERVE_TIMEOUT_S = 120.0  # a peer connection silent this long is closed (a dead peer frees its thread)
IDLE_CHANNEL_S = 60.0  # a sender reconnects rather than reuse a connection idle this long
MIN_RATE = 50e6  # bytes/s: the slowest a peer's copy may arrive and still count as coming (the heartbeat's deadline)


def header_of(rank: int, sealed: dict[str, Any]) -> dict[str, Any]:
    return {"rank": rank, **{k: sealed[k] for k in ("step", "used", "chunks", "entries", "json", "json_sha256")}}


# ---- the keeper's side: serve replicas, replicate its own ------------------------------------------

class PeerTier:
    """Lives in the keeper process: a TCP server holding other nodes' copies, and a sender thread."""

    def __init__(self, keeper: Any, node: int, nnodes: int, registry: Registry, token: str):
        self.keeper, self.node, self.nnodes, self.registry, self.token = keeper, node, nnodes, registry, token
        self.replicas: dict[int, list[Slot | None]] = {}  # global rank -> [slot 0, slot 1] (another node's)
        self.lock = threading.Lock()
        self.pending: dict[int, int] = {}  # rank -> step sealed and not yet sent
        self.wake = threading.Condition(self.lock)
        self.sent: dict[int, dict[str, Any]] = {}  # rank -> the last replication (step, node, bytes, seconds)
        self.server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        host = os.environ.get(HOST_ENV) or "127.0.0.1"  # one address, never all (launch/listen.py)
        self.server.bind((host, 0))
        self.server.listen(16)
        self.address = f"{host}:{self.server.getsockname()[1]}"

    def start(self) -> None:
        self.registry.register(self.node, self.address)
        threading.Thread(target=self._accept, daemon=True, name="keeper-peer-accept").start()
        if self.nnodes > 1:
            threading.Thread(target=self._replicate_loop, daemon=True, name="keeper-replicate").start()
        log.info("peer tier: node %d of %d at %s, replicating to the next registered node", self.node, self.nnodes,
                 self.address)

    # ---- sending (after each seal) ------------------------------------------------------------

    def sealed(self, rank: int, step: int) -> None:
        with self.wake:
            self.pending[rank] = step  # a newer seal replaces an unsent older one
            self.wake.notify()

    def _replicate_loop(self) -> None:
        channel, failing, backoff, used = None, False, 0.2, 0.0
        while not self.keeper.stopping.is_set():
            with self.wake:
                while not self.pending:
                    self.wake.wait()
                rank, step = self.pending.popitem()
            if channel is not None and time.monotonic() - used > IDLE_CHANNEL_S:
                channel.close()  # the receiver's side times out idle connections: start afresh
                channel = None
            try:
                target, address = self._target()
                channel = channel or Channel.client(address, self.token)
                self._send(channel, rank, step, target)
                failing, backoff, used = False, 0.2, time.monotonic()
            except (PeerError, OSError, KeyError, ValueError) as exc:
                if not failing:  # once per streak: a lost peer must not fill the log
                    log.warning("replication of rank %d step %d failed (retrying until it works): %s", rank, step, exc)
                failing = True
                if channel is not None:
                    channel.close()
                channel = None
                with self.wake:  # a peer still starting, or restarting: try again unless a newer seal came
                    self.pending.setdefault(rank, step)
                time.sleep(backoff)
                backoff = min(backoff * 2, 5.0)

    def _target(self) -> tuple[int, str]:
        """The next registered node after this one, in ring order (node i -> i + 1 when every node
        is registered; a campaign's surviving nodes 0 and 2 replicate to each other)."""
        others = {n: a for n, a in self.registry.addresses().items() if n != self.node}
        if not others:
            raise PeerError("no other node's keeper has registered yet")
        after = [n for n in sorted(others) if n > self.node]
        node = after[0] if after else min(others)
        return node, others[node]

    def _send(self, channel: Channel, rank: int, step: int, target: int) -> None:
        start = time.perf_counter()
        with self.keeper.lock:
            slot = next((s for s in self.keeper.slots.get(rank, []) if s is not None and s.sealed
                         and s.sealed["step"] == step), None)
            header = header_of(rank, slot.sealed) if slot is not None else None
        if header is None:
            return  # rewritten since its seal: a newer seal is queued
        channel.send({"op": "put", **header})
        channel.send_bytes(memoryview(slot.map)[:header["used"]])
        reply = channel.recv()
        if not reply.get("ok"):
            raise PeerError(reply.get("error"))
        seconds = time.perf_counter() - start
        with self.lock:
            self.sent[rank] = {"step": step, "node": target, "bytes": header["used"], "seconds": round(seconds, 4)}
        log.info("replicated rank %d step %d (%d bytes) to node %d in %.3f s", rank, step, header["used"], target,
                 seconds)

    # ---- serving (other nodes' keepers push; restarted ranks pull) -----------------------------

    def _accept(self) -> None:
        while not self.keeper.stopping.is_set():
            try:
                conn, peer = self.server.accept()
            except OSError:
                return
            try:
                serve_in_thread(self._serve, conn, peer)
            except RuntimeError:  # out of memory: the keeper cannot serve; it ends, its log says why
                log.exception("peer tier: a connection from %s could not be served: the keeper stops", peer)
                self.keeper.stopping.set()
                return

    def _serve(self, conn: socket.socket, peer: Any) -> None:
        conn.settimeout(SERVE_TIMEOUT_S)
        try:
            channel = Channel.server(conn, self.token)
            while True:
                request = channel.recv()
                op = request.get("op")
                if op == "put":
                    channel.send(self._put(channel, request))
                elif op == "list":
                    channel.send({"ok": True, "steps": self.servable(int(request["rank"]))})
                elif op == "get":
                    self._get(channel, int(request["rank"]), int(request["step"]))
                elif op == "drop":
                    channel.send({"ok": True, "dropped": self.drop(int(request["rank"]), int(request["after_step"]))})
                else:
                    channel.send({"ok": False, "error": f"unknown request {op!r}"})
        except PeerError as exc:
            log.warning("peer %s: %s", peer, exc)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass  # the peer went away (or sent garbage): its connection ends, the keeper goes on
        finally:
            conn.close()

    def _put(self, channel: Channel, header: dict[str, Any]) -> dict[str, Any]:
        rank, used = int(header["rank"]), int(header["used"])
        with self.lock:
            pair = self.replicas.setdefault(rank, [None, None])
            index = spare_slot(pair)
            slot = pair[index]
            if slot is None or slot.nbytes != used:
                if slot is not None:
                    slot.close()
                slot = pair[index] = Slot(f"megatrain-replica{rank}-slot{index}", used)
            slot.sealed = None
        channel.recv_into(memoryview(slot.map)[:used])  # read it all, even if bad: the stream stays in step
        bad = [i for i, (a, b) in enumerate(zip(chunk_hashes(memoryview(slot.map), used), header["chunks"],
                                                strict=True)) if a != b]
        if bad or text_hash(header["json"]) != header["json_sha256"]:
            return {"ok": False, "error": f"rank {rank} step {header['step']}: chunk(s) {bad} or the JSON differ on "
                                          "receipt (rewritten while sent, or damaged on the way)"}
        with self.lock:
            slot.sealed = {**{k: header[k] for k in ("step", "used", "chunks", "entries", "json", "json_sha256")},
                           "sealed_at": time.time()}
        return {"ok": True}

    def held(self, rank: int) -> list[int]:
        with self.lock:
            return sorted(s.sealed["step"] for s in self.replicas.get(rank, []) if s is not None and s.sealed)

    def replica(self, rank: int, step: int) -> tuple[Slot, dict[str, Any]] | None:
        with self.lock:
            for slot in self.replicas.get(rank, []):
                if slot is not None and slot.sealed and slot.sealed["step"] == step:
                    return slot, dict(slot.sealed)
        return None

    def _own(self, rank: int, step: int) -> tuple[Slot, dict[str, Any]] | None:
        with self.keeper.lock:
            for slot in self.keeper.slots.get(rank, []):
                if slot is not None and slot.sealed and slot.sealed["step"] == step:
                    return slot, dict(slot.sealed)
        return None

    def servable(self, rank: int) -> list[int]:
        """Steps of ``rank`` this keeper can hand to a rank on another node: replicas, and its own
        ranks' copies too (a relaunch may place a global rank on another node than before)."""
        with self.keeper.lock:
            own = [s.sealed["step"] for s in self.keeper.slots.get(rank, []) if s is not None and s.sealed]
        return sorted(set(self.held(rank)) | set(own))

    def _get(self, channel: Channel, rank: int, step: int) -> None:
        found = self.replica(rank, step) or self._own(rank, step)
        if found is None:
            channel.send({"ok": False, "error": f"rank {rank}: no replica of step {step}"})
            return
        slot, sealed = found
        channel.send({"ok": True, **header_of(rank, sealed)})
        channel.send_bytes(memoryview(slot.map)[:sealed["used"]])  # the rank checks every chunk's sha256

    def drop(self, rank: int, after_step: int) -> list[int]:
        dropped = []
        with self.lock:
            for slot in self.replicas.get(rank, []):
                if slot is not None and slot.sealed and slot.sealed["step"] > after_step:
                    dropped.append(slot.sealed["step"])
                    slot.sealed = None
        return dropped

    def status(self) -> dict[str, Any]:
        with self.lock:
            return {"node": self.node, "address": self.address, "sent": {str(r): v for r, v in self.sent.items()},
                    "replicas": {str(r): [s.sealed["step"] for s in pair if s is not None and s.sealed]
                                 for r, pair in self.replicas.items()}}


# ---- the rank's side: what the peers hold for it, and fetching it -----------------------------------

class PeerClient:
    """A restarted rank's view of the keepers' replicas: every registered keeper is asked, its own
    node's too (a relaunch may place this global rank on the node that held its replica)."""

    def __init__(self, registry: Registry, node: int, token: str):
        self.registry, self.node, self.token = registry, node, token

    def held(self, rank: int) -> dict[int, str]:
        """step -> the address of a peer keeper holding a replica of it for ``rank``."""
        found: dict[int, str] = {}
        # this node's own keeper last: its copies were the local tier, already tried (corrupt, say);
        # another node's replica of the same step is the next tier, not a second look at the same bytes
        for node, address in sorted(self.registry.addresses().items(), key=lambda item: (item[0] == self.node, item[0])):
            try:
                with waiting("peer keeper: list", address, CONNECT_TIMEOUT_S + READ_TIMEOUT_S):
                    channel = Channel.client(address, self.token)
                    channel.send({"op": "list", "rank": rank})
                    for step in channel.recv()["steps"]:
                        found.setdefault(int(step), address)
                    channel.close()
            except (PeerError, OSError, KeyError, ValueError) as exc:
                log.info("peer keeper of node %d (%s) not asked: %s", node, address, exc)
        return found

    def fetch(self, address: str, rank: int, step: int, allocate: Callable[[int], tuple[Any, memoryview]]
              ) -> tuple[dict[str, Any], Any]:
        """The header and bytes of ``rank``'s replica of ``step``, received straight into the buffer
        ``allocate(nbytes)`` makes (the rank: a tensor, so the keeper needs no torch); the caller
        checks the chunks."""
        with waiting("peer keeper: get", address, CONNECT_TIMEOUT_S + READ_TIMEOUT_S) as wait:
            channel = Channel.client(address, self.token)
            try:
                channel.send({"op": "get", "rank": rank, "step": step})
                header = channel.recv()
                if not header.get("ok"):
                    raise PeerError(header.get("error"))
                used = int(header["used"])
                # each read has READ_TIMEOUT_S; the whole copy at no less than MIN_RATE
                wait.deadline_s = wait.elapsed() + READ_TIMEOUT_S + used / MIN_RATE
                data, view = allocate(used)
                channel.recv_into(view[:used])
                return header, data
            finally:
                channel.close()

    def drop(self, rank: int, after_step: int) -> list[int]:
        dropped: list[int] = []
        for address in self.registry.addresses().values():
            try:
                with waiting("peer keeper: drop", address, CONNECT_TIMEOUT_S + READ_TIMEOUT_S):
                    channel = Channel.client(address, self.token)
                    channel.send({"op": "drop", "rank": rank, "after_step": after_step})
                    dropped += channel.recv().get("dropped", [])
                    channel.close()
            except (PeerError, OSError, KeyError, ValueError):
                continue  # a node that is gone holds nothing to drop
        return dropped
