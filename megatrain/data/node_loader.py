"""One data reader per node: local rank 0 reads storage and feeds every local rank via shared memory.

MegaScale's observation: with one loader per GPU, the 8 ranks of a node read and decode the same
shards 8 times (tensor-parallel peers even need identical batches). Here local rank 0 (the
*server*) owns the only ShardLoader of the node; it computes the batches of all local ranks at
once and writes them into a ring of shared-memory slots; the other local ranks (*clients*) copy
their part out. Nobody but the server touches storage.

The ring is a file on ``/dev/shm`` (tmpfs: memory, never disk) mapped by every local rank with
``np.memmap``; that is what ``multiprocessing.shared_memory`` does on Linux too, minus its
resource tracker, which before Python 3.13 unlinks a segment when *any* attached process exits.

Control channel: a Unix socket per node (``multiprocessing.connection``, authenticated), named
from a ``channel`` string all local ranks agree on. It carries small messages only:

    client -> server   hello(local rank, dp rank, loader params)   once
    server -> client   ring(ring file path, shape, dtype)          once
    server -> client   batch(stream position, slot, bad shards)    per step
    client -> server   ack(slot)                                   per step: the slot may be reused
    both ways          bye / close / error(text, deterministic?)

The node serves whatever source the loaders take: one shard version or a weighted mixture of
versions (mixture.py); the batch at a stream position is the per-rank loader's either way.

A slot is reused only after every local rank acked it, so the ring is the prefetch queue and
provides back-pressure. Every rank calls skip()/load_state_dict() at the same point of training
(the trainer does); the server restarts its producer at the new position and clients drop
messages for positions they no longer expect. Because a batch is a pure function of its stream
position, a message that survives a seek still holds the right data.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import tempfile
import threading
import time
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

import numpy as np
import torch

from megatrain.data.index import DataError
from megatrain.errors import DeterministicError, InputError
from megatrain.data.loader import ShardLoader, stream_order, to_tensors
from megatrain.data.position import PositionedLoader, as_cursors

log = logging.getLogger(__name__)


def default_channel(source: Any) -> str:
    """A name the local ranks of one job agree on without talking: the job's rendezvous identity."""
    env = os.environ
    return "-".join([env.get("TORCHELASTIC_RUN_ID", ""), env.get("MASTER_ADDR", ""), env.get("MASTER_PORT", ""),
                     env.get("GROUP_RANK", env.get("NODE_RANK", "")), source.version])


def _names(channel: str) -> tuple[str, str, bytes]:
    """Socket path, ring file path and authentication key of a channel."""
    digest = hashlib.sha256(channel.encode()).hexdigest()
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    stem = f"megatrain-node-{digest[:16]}"
    return os.path.join(tempfile.gettempdir(), stem + ".sock"), os.path.join(shm, stem + ".ring"), digest.encode()


def _error_message(exc: BaseException) -> tuple[str, str, bool]:
    """The error the server sends its clients: text, and whether it is deterministic (a bad shard
    under on_bad_shard=error), so every rank of the node fails the same way, without restarts."""
    return ("error", f"{exc.__class__.__name__}: {exc}", isinstance(exc, DeterministicError))


def _raise_from_server(message: tuple, where: str) -> None:
    deterministic = len(message) > 2 and message[2]
    raise (InputError if deterministic else DataError)(f"{where}: {message[1]}")


class NodeLoader(PositionedLoader):
    """What both roles share: the loader interface; the position and its state come from
    PositionedLoader, like ShardLoader's, so either loader can restore the other's state."""

    def __init__(self, source: Any, params: dict[str, Any], local_rank: int) -> None:
        mb, dp_size = params["micro_batch_size"], params["dp_size"]
        order = stream_order(source, seed=params["seed"], shuffle_shards=params["shuffle_shards"],
                             micro_batch_size=mb, dp_size=dp_size, start=params.get("start"))
        super().__init__(order, micro_batch_size=mb, dp_size=dp_size)
        self.params, self.local_rank = params, local_rank
        self._bad_shards = 0  # as reported with the last batch by the server's ShardLoader
        self.view: np.ndarray | None = None  # np.memmap [slots, local ranks, mb, seq_len + 1]

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        window = self._next_window()
        self._advance()
        return to_tensors(window)

    def _next_window(self) -> np.ndarray:
        raise NotImplementedError

    @property
    def bad_shards(self) -> int:
        return self._bad_shards

    def close(self) -> None:
        self.view = None  # unmaps the ring in this process


class NodeServer(NodeLoader):
    """Local rank 0: the node's only reader."""

    def __init__(self, source: Any, params: dict[str, Any], dp_rank: int, local_world_size: int,
                 channel: str, timeout_s: float, rank: int | None = None) -> None:
        super().__init__(source, params, 0)
        self.address, self.ring_path, key = _names(channel)
        if os.path.exists(self.address):
            os.unlink(self.address)  # left by a crashed run: binding would fail
        self.listener = Listener(self.address, family="AF_UNIX", authkey=key)
        self.clients = self._accept(local_world_size - 1, timeout_s)  # local rank -> connection

        dp_of_local = [dp_rank] + [self.clients[r][1] for r in range(1, local_world_size)]
        unique = sorted(set(dp_of_local))
        self.rows = [unique.index(d) for d in dp_of_local]  # batch row of each local rank
        try:
            keys = ("micro_batch_size", "dp_size", "seed", "on_bad_shard", "verify_checksums", "shuffle_shards",
                    "vocab_size", "start")
            self.loader = ShardLoader(source, dp_ranks=unique, prefetch_batches=0, rank=rank,
                                      **{k: params[k] for k in keys})
        except Exception as exc:  # e.g. a dp_rank out of range: tell the clients before failing
            for conn, _ in self.clients.values():
                conn.send(_error_message(exc))
            self.listener.close()
            raise
        slots = max(2, params["prefetch_batches"])
        shape = (slots, local_world_size, params["micro_batch_size"], source.seq_len + 1)
        self.view = np.memmap(self.ring_path, source.np_dtype, mode="w+", shape=shape)

        self.cond = threading.Condition()
        self.pending = [0] * slots  # readers that have not released each slot yet
        self.held = {r: set() for r in self.clients}  # slots each client still holds
        self.next_slot = 0
        self.stopping = False
        self.own: queue.Queue = queue.Queue()  # (position, slot) or an exception, for local rank 0
        for rank, (conn, _) in self.clients.items():
            conn.send(("ring", self.ring_path, shape, source.dtype))
            threading.Thread(target=self._receive, args=(rank, conn), daemon=True, name=f"node-loader-ack{rank}").start()
        self.producer = self._start()
        log.info("node loader: local rank 0 serves %d local ranks (dp ranks %s) through %s",
                 local_world_size, dp_of_local, self.ring_path)

    def _accept(self, n: int, timeout_s: float) -> dict[int, tuple[Connection, int]]:
        clients: dict[int, tuple[Connection, int]] = {}
        failure: list[BaseException] = []

        def accept_all() -> None:
            try:
                while len(clients) < n:
                    conn = self.listener.accept()
                    hello = conn.recv()
                    if not 1 <= hello["local_rank"] <= n or hello["local_rank"] in clients:
                        conn.send(("error", f"local rank {hello['local_rank']} is duplicate or outside 1..{n}"))
                        raise DataError(f"node loader: unexpected local rank {hello['local_rank']}")
                    if {k: hello["params"].get(k) for k in self.params} != self.params:
                        conn.send(("error", f"local rank {hello['local_rank']} has loader params {hello['params']}, "
                                            f"local rank 0 has {self.params}"))
                        raise DataError(f"node loader: local rank {hello['local_rank']} disagrees on loader params")
                    clients[hello["local_rank"]] = (conn, hello["dp_rank"])
            except BaseException as exc:  # the listener closed by a timeout lands here too
                failure.append(exc)

        thread = threading.Thread(target=accept_all, daemon=True)
        thread.start()
        thread.join(timeout_s)
        if thread.is_alive() or failure:
            self.listener.close()
            missing = sorted(set(range(1, n + 1)) - set(clients))
            raise DataError(f"node loader: local ranks {missing} did not connect within {timeout_s:.0f} s"
                            if not failure else f"node loader: {failure[0]}")
        return clients

    # -- the producer thread and slot bookkeeping
    def _start(self) -> threading.Thread:
        self.stopping = False
        thread = threading.Thread(target=self._produce, daemon=True, name="node-loader-producer")
        thread.start()
        return thread

    def _produce(self) -> None:
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self.stopping or self.pending[self.next_slot] == 0)
                if self.stopping:
                    return
                slot = self.next_slot
            pos = self.loader.samples_consumed
            try:
                batch = self.loader.next_raw()  # the only storage reads of the node happen here
            except Exception as exc:
                self._broadcast(_error_message(exc))
                self.own.put(exc)
                return
            self.view[slot] = batch[self.rows]
            with self.cond:
                self.pending[slot] = 1 + len(self.held)
                for slots in self.held.values():
                    slots.add(slot)
                self.next_slot = (slot + 1) % len(self.pending)
            self._broadcast(("batch", pos, slot, self.loader.bad_shards))
            self.own.put((pos, slot))

    def _broadcast(self, message: tuple) -> None:
        for rank in list(self.held):
            try:
                self.clients[rank][0].send(message)
            except OSError:
                self._drop(rank)

    def _release(self, slot: int, rank: int | None = None) -> None:
        with self.cond:
            if rank is not None:
                if slot not in self.held.get(rank, ()):
                    return
                self.held[rank].discard(slot)
            self.pending[slot] -= 1
            self.cond.notify_all()

    def _drop(self, rank: int) -> None:
        """A client left: release what it held so the producer never waits for it."""
        with self.cond:
            for slot in self.held.pop(rank, set()):
                self.pending[slot] -= 1
            self.cond.notify_all()

    def _receive(self, rank: int, conn: Connection) -> None:
        try:
            while True:
                message = conn.recv()
                if message[0] == "ack":
                    self._release(message[1], rank)
                elif message[0] == "bye":
                    break
        except Exception:  # EOF, or the connection closed under us by close()
            pass
        self._drop(rank)

    # -- the loader interface of local rank 0
    def _next_window(self) -> np.ndarray:
        while True:
            item = self.own.get()
            if isinstance(item, BaseException):
                self.seek(self.samples_consumed)  # restart the producer: the next call retries
                raise item
            pos, slot = item
            window = self.view[slot, 0].copy() if pos == self.samples_consumed else None
            self._release(slot)
            if window is not None:
                self._bad_shards = self.loader.bad_shards
                return window

    def _stop_producer(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        self.producer.join()

    def _restore_order(self, state: dict[str, Any]) -> None:
        self._stop_producer()  # it reads batches in the order being changed; seek() restarts it
        try:
            super()._restore_order(state)
            self.loader._restore_order(state)
        except BaseException:
            self.producer = self._start()  # refused: go on serving the position we are at
            raise

    def seek(self, pos: int) -> None:
        """Restart the producer at ``pos``; batches it made for other positions are released."""
        self._stop_producer()
        while not self.own.empty():
            item = self.own.get()
            if not isinstance(item, BaseException):
                self._release(item[1])
        super().seek(pos)
        self.loader.seek(pos)
        self.producer = self._start()

    def close(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        self.producer.join(timeout=30)
        self._broadcast(("close",))
        for conn, _ in self.clients.values():
            conn.close()
        self.listener.close()
        super().close()
        for path in (self.ring_path, self.address):
            if os.path.exists(path):
                os.unlink(path)  # clients keep their mapping; the memory is freed when all unmap


class NodeClient(NodeLoader):
    """Local ranks 1..n-1: read batches from the shared ring, never from storage."""

    def __init__(self, source: Any, params: dict[str, Any], local_rank: int, dp_rank: int,
                 channel: str, timeout_s: float) -> None:
        super().__init__(source, params, local_rank)
        address, _, key = _names(channel)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.conn = Client(address, family="AF_UNIX", authkey=key)
                break
            except (FileNotFoundError, ConnectionRefusedError):  # the server is not listening yet
                if time.monotonic() > deadline:
                    raise DataError(f"node loader: local rank 0 did not open {address} within {timeout_s:.0f} s") from None
                time.sleep(0.05)
        self.conn.send({"local_rank": local_rank, "dp_rank": dp_rank, "params": params})
        try:
            message = self.conn.recv()
        except (EOFError, OSError):
            raise DataError("node loader: local rank 0 failed while setting up (see its log)") from None
        if message[0] == "error":
            _raise_from_server(message, f"node loader (local rank {local_rank})")
        _, path, shape, dtype = message
        self.view = np.memmap(path, np.dtype(dtype), mode="r", shape=tuple(shape))

    def _next_window(self) -> np.ndarray:
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                raise DataError("node loader: local rank 0 closed the connection") from None
            if message[0] == "error":
                _raise_from_server(message, f"node loader (local rank {self.local_rank}, read by local rank 0)")
            if message[0] == "close":
                raise DataError("node loader: local rank 0 closed the loader")
            _, pos, slot, bad = message
            window = self.view[slot, self.local_rank].copy() if pos == self.samples_consumed else None
            try:
                self.conn.send(("ack", slot))  # stale batches (after a seek) are released unread
            except OSError:  # local rank 0 finished and closed first: nobody waits for this slot,
                pass  # and our mapping of the ring still holds the batch it announced
            if window is not None:
                self._bad_shards = bad
                return window

    def close(self) -> None:
        try:
            self.conn.send(("bye",))
        except OSError:
            pass
        self.conn.close()
        super().close()


def build_node_loader(source: Any, *, local_rank: int, local_world_size: int, micro_batch_size: int,
                      dp_rank: int, dp_size: int, seed: int, prefetch_batches: int = 4, on_bad_shard: str = "error",
                      verify_checksums: bool = True, shuffle_shards: int = 64, channel: str | None = None,
                      timeout_s: float = 300.0, vocab_size: int | None = None, rank: int | None = None,
                      start: Any = None) -> NodeLoader:
    """The loader of one local rank when the node shares one reader (``parallel.node_loader``).

    ``source``: a ShardIndex, or a ``mixture.Mixture`` (weighted components and their exhaustion
    policy) - the same source ``build_loader`` takes. Every local rank of the node calls this with
    the same ``channel`` (default: derived from the torchrun rendezvous variables), the same
    source and the same loader parameters; each passes its own dp_rank. The result behaves like
    ``build_loader``'s ShardLoader (``component_stats()`` included).

    The ranks that join must all call ``next()`` in lockstep (one call each per micro-batch): a
    slot is reused only when every rank released it. Ranks that never read data (middle pipeline
    stages) must not join; number the reading ranks of the node 0..n-1 as ``local_rank`` and pass
    n as ``local_world_size``.
    """
    params = {"micro_batch_size": micro_batch_size, "dp_size": dp_size, "seed": seed, "on_bad_shard": on_bad_shard,
              "verify_checksums": verify_checksums, "shuffle_shards": shuffle_shards,
              "prefetch_batches": prefetch_batches, "version": source.version, "vocab_size": vocab_size,
              "start": as_cursors(start)}  # the previous stage's cursors (position.py)
    if hasattr(source, "exhausted"):  # a mixture: its version covers components and weights, not the policy
        params["exhausted"] = source.exhausted
    channel = channel if channel is not None else default_channel(source)
    if local_rank == 0:
        return NodeServer(source, params, dp_rank, local_world_size, channel, timeout_s, rank)
    return NodeClient(source, params, local_rank, dp_rank, channel, timeout_s)
