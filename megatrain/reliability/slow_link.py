"""The straggler view of a hosts cluster: a slow *link* named by its host, not a slow rank.

A rank on a host whose link is rate-limited (``slow_link``: tbf on its bridge end) computes as fast as
ever; what grows is its collectives, and in a synchronous step every peer waits with it, so the rank
watcher's rule (``observe.straggler.slow_ranks`` on forward times: one rank slower than its peers)
sees nothing: all ranks are equally slow. Two pieces of evidence name the host instead:

1. from the heartbeats (``recent_step_s``, ``recent_forward_s``): every rank's step time is over
   ``1 + reliability.straggler_slowdown`` times its own steady time (the lowest median of three steps
   seen in this attempt), and over that factor times its forward's own slowdown: the slowdown is in
   communication, not compute (a busy machine slows forward too, by less: a fixed limit on forward's
   ratio let the jitter of a loaded machine reset a slow link's clock at every read);
2. from the links: while that holds, the watch sends each node host an ICMP echo of ``PROBE_BYTES``
   (the host's kernel answers: no process of the host is involved) from the machine's side of the
   bridge; the host whose echo takes over ``PROBE_FACTOR`` times its peers' median (and at least
   ``PROBE_MIN_MS``) is the slow link. Its peers' ranks are the ones waiting on it.

The finding goes to ``<run_dir>/faults/slow-link.json`` and the launcher's log once (host, hostname,
address, its bridge link, ranks, the step and forward ratios, the probe times). With
``reliability.evict_slow_host_after_s`` the host that stays slow that long is returned as a verdict
(``cause: slow_link``) that the launcher handles as a lost host (``on_node_loss``: shrink or end).

Engine code: imports neither torch nor prefect.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import struct
import time
from pathlib import Path

PROBE_BYTES = 32_000  # ~22 frames: at tens of Mbit/s a healthy veth answers in well under a millisecond
PROBE_FACTOR = 5.0
PROBE_MIN_MS = 2.0
PROBE_EVERY_S = 2.0
WINDOW = 3  # steps per median: one slow step (a checkpoint, a busy machine) is not a slow link


def _checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    total = (total >> 16) + (total & 0xFFFF)
    total += total >> 16
    return ~total & 0xFFFF


def echo_ms(address: str, payload: int = PROBE_BYTES, timeout_s: float = 1.0) -> float | None:
    """Round trip of one ICMP echo of ``payload`` bytes to ``address`` in ms (None: no answer in time).
    A raw socket: root, as the cluster itself needs."""
    ident, seq = os.getpid() & 0xFFFF, int(time.monotonic() * 1000) & 0xFFFF
    body = bytes(payload)
    header = struct.pack("!BBHHH", 8, 0, 0, ident, seq)
    packet = struct.pack("!BBHHH", 8, 0, _checksum(header + body), ident, seq) + body
    with socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP) as sock:
        sock.settimeout(timeout_s)
        start = time.perf_counter()
        sock.sendto(packet, (address, 0))
        deadline = start + timeout_s
        while True:
            try:
                data, (source, _) = sock.recvfrom(65_535)
            except (socket.timeout, TimeoutError):
                return None
            header_len = (data[0] & 0x0F) * 4
            kind, _, _, got_ident, got_seq = struct.unpack("!BBHHH", data[header_len:header_len + 8])
            if source == address and kind == 0 and (got_ident, got_seq) == (ident, seq):
                return (time.perf_counter() - start) * 1000.0
            if time.perf_counter() > deadline:
                return None
            sock.settimeout(max(0.01, deadline - time.perf_counter()))


def probe_ms(address: str, tries: int = 3) -> float:
    """The fastest of ``tries`` echoes (scheduling on a busy machine only ever adds); inf if none came back."""
    times = [t for t in (echo_ms(address) for _ in range(tries)) if t is not None]
    return min(times) if times else float("inf")


def _median_window(values: list[float]) -> float | None:
    return statistics.median(values[-WINDOW:]) if len(values) >= WINDOW else None


class SlowLinkView:
    """Fed every read of the stage's heartbeats by the host watch; returns an eviction verdict or None."""

    def __init__(self, cfg, cluster, nodes: list[int], nproc: int, role_of, probe=probe_ms) -> None:
        rel = cfg.reliability
        self.cluster, self.nodes, self.nproc, self.role_of, self.probe = cluster, nodes, nproc, role_of, probe
        self.factor = 1.0 + (rel.straggler_slowdown if rel.straggler_slowdown is not None else 0.5)
        self.evict_after_s = rel.evict_slow_host_after_s
        self.path = Path(cfg.train.run_dir) / "faults" / "slow-link.json"
        self.steady: dict[int, tuple[float, float]] = {}  # rank -> lowest (step s, forward s) medians seen
        self.finding: dict | None = None
        self.slow_since: float | None = None
        self._probed_at = 0.0

    def _ratios(self, records: dict) -> dict[int, tuple[float, float]] | None:
        """rank -> (step time, forward time) over its steady ones; None unless every rank has a window."""
        ratios = {}
        for rank in range(self.nproc * len(self.nodes)):
            record = records.get(rank)
            step_s = _median_window(list(record.recent_step_s or [])) if record is not None else None
            forward = _median_window([f for _, f in record.recent_forward_s or []]) if record is not None else None
            if step_s is None or forward is None:
                return None
            steady_step, steady_forward = self.steady.get(rank, (step_s, forward))
            self.steady[rank] = (min(steady_step, step_s), min(steady_forward, forward))
            ratios[rank] = (step_s / max(self.steady[rank][0], 1e-6), forward / max(self.steady[rank][1], 1e-6))
        return ratios

    def __call__(self, records: dict, now: float | None = None) -> dict | None:
        now = time.time() if now is None else now
        ratios = self._ratios(records)
        # the step slowed past the factor, and by the factor more than forward did: on a busy machine forward
        # alone jitters 1.5-2x (a 4-rank cluster on 2 cores, load 15-22: named at 5.6x step, 1.36x forward,
        # then forward medians of 1.5-1.9x reset the eviction clock at every read until the stage ended)
        comm_bound = ratios is not None and all(s > self.factor and f * self.factor < s for s, f in ratios.values())
        if not comm_bound:
            self.slow_since = None  # the steps recovered (or compute is what slowed): nothing to name now
            return None
        if self.finding is None or now - self._probed_at >= PROBE_EVERY_S:
            self._probed_at = now
            slow = self._probe_links(records, ratios)
            if slow is None:
                self.slow_since = None
                return None
            if self.finding is None or self.finding["node"] != slow["node"]:
                self.finding = {**slow, "first_seen": now}
                self._report(self.finding)
            self.slow_since = self.slow_since or self.finding["first_seen"]
        if self.evict_after_s is None or self.slow_since is None or now - self.slow_since < self.evict_after_s:
            return None
        slow = self.finding
        return {**{k: slow[k] for k in ("node", "host", "hostname", "address", "ranks", "last_step")},
                "silent_s": 0.0, "cause": "slow_link", "link": slow["link"], "slow_for_s": round(now - self.slow_since, 1),
                "evidence": "slow link: step vs forward times in the heartbeats, the link's echo vs its peers'",
                "message": f"host {slow['hostname']} ({slow['address']}) evicted: its link {slow['link']} slow for "
                           f"{now - self.slow_since:.1f} s (reliability.evict_slow_host_after_s="
                           f"{self.evict_after_s:g}; {slow['why']})"}

    def _probe_links(self, records: dict, ratios: dict[int, tuple[float, float]]) -> dict | None:
        times = {node: self.probe(self.cluster.host(self.role_of(node)).address) for node in self.nodes}
        for position, node in enumerate(self.nodes):
            peers = [t for n, t in times.items() if n != node]
            reference = statistics.median(peers) if peers else 0.0
            if times[node] < max(PROBE_MIN_MS, PROBE_FACTOR * reference):
                continue
            role = self.role_of(node)
            host = self.cluster.host(role)
            ranks = list(range(position * self.nproc, (position + 1) * self.nproc))
            beats = [records[r] for r in ranks if r in records]
            step_ratio = statistics.median(s for s, _ in ratios.values())
            forward_ratio = statistics.median(f for _, f in ratios.values())
            waiting = sorted(set(ratios) - set(ranks))
            why = (f"every rank's step {step_ratio:.1f}x its steady time, forward {forward_ratio:.2f}x; a "
                   f"{PROBE_BYTES // 1000} KB echo takes {times[node]:.1f} ms there, {reference:.2f} ms to its peers")
            return {"node": node, "host": role, "hostname": next((b.host for b in beats), role),
                    "address": host.address, "link": host.link, "ranks": ranks, "waiting": waiting,
                    "last_step": max((b.step for b in beats), default=None), "step_ratio": round(step_ratio, 2),
                    "forward_ratio": round(forward_ratio, 2), "probe_ms": round(times[node], 2),
                    "peers_probe_ms": round(reference, 2), "why": why,
                    "message": f"slow link: host {next((b.host for b in beats), role)} ({host.address}), link "
                               f"{host.link}, node {node}, ranks {ranks} (ranks {waiting} wait on it): {why}"}
        return None

    def _report(self, finding: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(finding))
        tmp.replace(self.path)
        print(f"[host_watch] {finding['message']}", flush=True)
