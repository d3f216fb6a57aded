"""Per-node self-check: is this machine fit to train? (MegaScale's diagnostic tests.)

Run on every node before training and after a fault, before the job is resumed. Each check
measures one thing a bad node gets wrong, and compares it with a floor (or a ceiling) from
``reliability.selfcheck``:

- GEMM throughput (TFLOP/s): a throttled or faulty GPU.
- memory copy bandwidth (GB/s, read + write): bad HBM / DRAM.
- intra-node all-reduce bus bandwidth (GB/s) over the node's local processes, gloo on CPU and
  NCCL on GPU: a broken NVLink/PCIe link. Bus bandwidth = algorithm bandwidth * 2(n-1)/n, the
  per-link traffic of a ring all-reduce, comparable across process counts.
- storage round trip (MB/s): the checkpoint URL is writable and readable from this node, and has
  room for two checkpoints (the preflight's probe).
- Redis PING round trip (ms), when a Redis URL is configured: the control plane is reachable.

On a GPU the GEMM, copy and all-reduce figures are also judged against the card's kind
(``gpu_verdict``, figures from ``gpu_expected``): below ``gpu_min_fraction`` x expected is
``slow``, a failure with ``strict`` and a warning without.

The result is a ``NodeReport``; the orchestrator merges one per node into a
``SelfCheckReport`` whose ``failing_nodes()`` is the eviction list.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from megatrain.config import Config, ConfigError, SelfCheckConfig, load_config


@dataclass
class CheckResult:
    name: str
    value: float | None  # None: the check could not run (see detail); that fails it
    threshold: float
    unit: str
    passed: bool
    higher_is_better: bool = True
    detail: str = ""
    # GPU checks only (gpu_verdict.py): the card's expected figure, value / expected, and the
    # verdict ("ok", "slow", "unknown card (no expected figures)")
    expected: float | None = None
    fraction: float | None = None
    verdict: str = ""


@dataclass
class NodeReport:
    node: str
    device: str
    checks: list[CheckResult] = field(default_factory=list)
    card: str = ""  # the expected-figures table's name of the card judged ("" when none)
    warnings: list[str] = field(default_factory=list)  # slow or unknown card, not failed on

    @property
    def passed(self) -> bool:
        return all(check.passed for check in self.checks)

    @property
    def failing(self) -> list[str]:
        return [check.name for check in self.checks if not check.passed]


@dataclass
class SelfCheckReport:
    nodes: list[NodeReport]

    @property
    def passed(self) -> bool:
        return all(node.passed for node in self.nodes)

    def failing_nodes(self) -> list[str]:
        """The eviction list: nodes with any failed check."""
        return [node.node for node in self.nodes if not node.passed]

    def to_json(self) -> str:
        data = {"passed": self.passed, "failing_nodes": self.failing_nodes(),
                "nodes": [asdict(node) for node in self.nodes]}
        return json.dumps(data, indent=2)

    @classmethod
    def from_json(cls, text: str) -> SelfCheckReport:
        nodes = []
        for node in json.loads(text)["nodes"]:
            checks = [CheckResult(**check) for check in node.pop("checks")]
            nodes.append(NodeReport(**node, checks=checks))
        return cls(nodes)

    @classmethod
    def merge(cls, reports: list[SelfCheckReport]) -> SelfCheckReport:
        return cls([node for report in reports for node in report.nodes])

    def table(self) -> str:
        lines = [f"{'node':<20} {'check':<18} {'value':>12} {'limit':>12} {'expected':>16} {'unit':<8} result"]
        for node in self.nodes:
            for c in node.checks:
                value = "n/a" if c.value is None else f"{c.value:.4g}"
                limit = ("min " if c.higher_is_better else "max ") + f"{c.threshold:.4g}"
                expected = "" if c.expected is None else f"{c.expected:.4g}"
                expected += "" if c.fraction is None else f" ({c.fraction:.2f}x)"
                verdict = "ok" if c.passed else "FAIL" + (f" ({c.detail})" if c.detail else "")
                if c.verdict and c.verdict != "ok" and c.passed:
                    verdict += f", {c.verdict}"
                lines.append(f"{node.node[:20]:<20} {c.name:<18} {value:>12} {limit:>12} {expected:>16} "
                             f"{c.unit:<8} {verdict}")
            if node.card:
                lines.append(f"{node.node[:20]:<20} judged as {node.card} ({node.device})")
            lines += [f"{node.node[:20]:<20} warning: {w}" for w in node.warnings]
        lines.append("all nodes passed" if self.passed else f"failing nodes: {self.failing_nodes()}")
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# The measurements. Each returns one number; timing loops run until a minimum time has passed
# so that a fast GPU and a slow CPU both get a stable figure without a fixed iteration count.


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _seconds_per_call(fn: Callable[[], object], device: torch.device, min_time_s: float = 0.3) -> float:
    fn()  # warm-up: allocation, kernel selection
    _sync(device)
    calls, start = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        _sync(device)
        elapsed = time.perf_counter() - start
        if elapsed >= min_time_s or calls >= 1000:
            return elapsed / calls


def gemm_tflops(device: torch.device, size: int) -> float:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    seconds = _seconds_per_call(lambda: torch.mm(a, b), device)
    return 2 * size**3 / seconds / 1e12


def memory_bandwidth_gbs(device: torch.device, megabytes: int) -> float:
    src = torch.empty(megabytes * 2**20, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    seconds = _seconds_per_call(lambda: dst.copy_(src), device)
    return 2 * src.numel() / seconds / 1e9  # a copy reads and writes every byte


def allreduce_busbw_gbs(nproc: int, megabytes: int, timeout_s: float = 120.0) -> float:
    """Bus bandwidth of an all-reduce among ``nproc`` fresh local processes (gloo over
    loopback on CPU, NCCL on GPU), each running ``_allreduce_bench``."""
    nbytes = megabytes * 2**20
    env = {**os.environ}
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # intra-node test: loopback, never a slow DNS lookup
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        logs = [Path(tmp) / f"rank{rank}.log" for rank in range(nproc)]
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "megatrain.reliability._allreduce_bench",
                 str(rank), str(nproc), str(Path(tmp) / "store"), str(nbytes), str(result)],
                env=env, stdout=logs[rank].open("w"), stderr=subprocess.STDOUT,
            )
            for rank in range(nproc)
        ]
        deadline = time.monotonic() + timeout_s
        try:
            # Poll them all: one rank failing leaves the others waiting in rendezvous forever.
            while any(proc.poll() is None for proc in procs):
                failed = [r for r, proc in enumerate(procs) if proc.returncode not in (None, 0)]
                if failed or time.monotonic() > deadline:
                    rank = failed[0] if failed else 0
                    why = f"exited {procs[rank].returncode}" if failed else f"timed out after {timeout_s:.0f} s"
                    raise RuntimeError(f"all-reduce rank {rank} {why}: {logs[rank].read_text()[-2000:]}")
                time.sleep(0.05)
            for rank, proc in enumerate(procs):
                if proc.returncode != 0:
                    raise RuntimeError(f"all-reduce rank {rank} exited {proc.returncode}: {logs[rank].read_text()[-2000:]}")
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        seconds = json.loads(result.read_text())["seconds_per_call"]
    algbw = nbytes / seconds
    return algbw * 2 * (nproc - 1) / nproc / 1e9


def storage_roundtrip_mbs(cfg: Config, url: str, megabytes: int) -> float:
    """Write (atomically, as checkpoints are committed), read back, verify and delete a test
    file under ``url``, through ``megatrain.storage`` so every supported scheme is covered: the
    preflight's probe (``reliability/preflight.py``), which also fails the check when the durable
    store has no room for two checkpoints, naming the location and the bytes."""
    from megatrain.reliability.preflight import storage_check

    result = storage_check(cfg, url, megabytes * 2**20)
    return 2 * result.nbytes / (result.write_s + result.read_s) / 1e6


def redis_rtt_ms(url: str, pings: int = 50) -> float:
    from megatrain.launch.redis_client import connect

    client = connect(url, socket_timeout=5.0, socket_connect_timeout=5.0)
    try:
        client.ping()
        samples = []
        for _ in range(pings):
            start = time.perf_counter()
            client.ping()
            samples.append((time.perf_counter() - start) * 1e3)
        return statistics.median(samples)
    finally:
        client.close()


# ---------------------------------------------------------------------------------------------
# Running the checks on this node.


def _measure(name: str, unit: str, threshold: float, fn: Callable[[], float], higher_is_better: bool = True) -> CheckResult:
    try:
        value = fn()
    except Exception as exc:  # a check that cannot run is a failed check, with the reason
        return CheckResult(name, None, threshold, unit, False, higher_is_better, f"{type(exc).__name__}: {exc}")
    passed = value >= threshold if higher_is_better else value <= threshold
    return CheckResult(name, value, threshold, unit, passed, higher_is_better)


def _judge_card(report: NodeReport, sc: SelfCheckConfig) -> None:
    """The GPU figures against the card's kind (``gpu_verdict``): a new concern kept apart."""
    from megatrain.reliability.gpu_verdict import judge_checks, warnings_of

    report.card = judge_checks(report.device, report.checks, sc)
    report.warnings = warnings_of(report.device, report.checks, sc)


def run_node_checks(cfg: Config, node: str | None = None) -> NodeReport:
    """All checks on this node, with the thresholds and sizes of ``cfg.reliability.selfcheck``,
    the GPU figures judged against the card's expected ones."""
    sc: SelfCheckConfig = cfg.reliability.selfcheck
    node = node or socket.gethostname()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    report = NodeReport(node=node, device=torch.cuda.get_device_name(0) if cuda else "cpu")
    add = report.checks.append

    add(_measure("gemm", "TFLOP/s", sc.min_gemm_tflops,
                 lambda: gemm_tflops(device, sc.gemm_size or (8192 if cuda else 1024))))
    add(_measure("memory_copy", "GB/s", sc.min_memory_gbs,
                 lambda: memory_bandwidth_gbs(device, sc.copy_mb or (1024 if cuda else 64))))
    nproc = sc.nproc_per_node or (torch.cuda.device_count() if cuda else 2)
    if nproc > 1:
        add(_measure(f"allreduce_x{nproc}", "GB/s", sc.min_allreduce_busbw_gbs,
                     lambda: allreduce_busbw_gbs(nproc, sc.allreduce_mb or (1024 if cuda else 8))))
    storage_url = sc.storage_url or cfg.checkpoint.durable_url
    add(_measure("storage", "MB/s", sc.min_storage_mbs,
                 lambda: storage_roundtrip_mbs(cfg, storage_url, sc.storage_mb)))
    if cfg.reliability.redis_url:
        add(_measure("redis_rtt", "ms", sc.max_redis_rtt_ms,
                     lambda: redis_rtt_ms(cfg.reliability.redis_url or ""), higher_is_better=False))
    _judge_card(report, sc)
    return report


def cli(argv: list[str]) -> int:
    """``megatrain selfcheck --config PATH [key=value ...] [--out report.json] [--node NAME]``;
    exit status 0 when every check passed, 1 when one failed, 2 for a bad config."""
    parser = argparse.ArgumentParser(prog="megatrain selfcheck", description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="recipe YAML (default: built-in defaults)")
    parser.add_argument("--out", help="write the JSON report here")
    parser.add_argument("--node", help="node name in the report (default: hostname)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. reliability.selfcheck.min_gemm_tflops=100")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    report = SelfCheckReport([run_node_checks(cfg, args.node)])
    print(report.table())
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(report.to_json() + "\n")
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
