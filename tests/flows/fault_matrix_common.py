"""What the fault-matrix test modules share (``tests/flows/test_fault_matrix_*.py``): the campaign
they run, the flow's log capture, the checks on committed checkpoints, the detection/recovery
table, and the module fixtures (a fault-free reference run, MKL pinned for bit-exactness).

Every case runs the ``pretrain`` flow against a real Prefect server with real ranks (torchrun,
gloo, the real data pipeline), injects one fault, and checks that it is detected, that the
campaign recovers without a person, that no committed checkpoint is lost, and - where the fault
does not change the math - that every committed checkpoint equals a fault-free run's bit for bit.

Times come from the fault's marker file (``<run_dir>/faults/fired-<kind>-*.json``, written just
before it fires) and from the flow's log records (the ranks' output is streamed into it):
detection = the first record that shows the fault was seen; recovery = the first record that
shows the campaign past it (usually: the next attempt finished the fault's step). Run with
``-s`` to see the table.

Not a test module: a test module imports the fixtures it uses by name (and the autouse ones,
``fault_table`` and ``reproducible_cpu_math``), so each gets them at its own module scope.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from megatrain.observe.log_records import TimedLogRecords

from megatrain.config.campaign import load_campaign, stage_config
from megatrain.checkpoint import catalog
from megatrain.checkpoint.files import load_safetensors, step_dir_name
from megatrain.checkpoint.restore import verify_checkpoint

ROOT = Path(__file__).resolve().parents[2]
STEPS = 8
COMMITTED = [4, 6, 8]  # checkpoint.interval=2 and the default keep_last=3
INTERVAL_S = 0.5  # heartbeat interval in every case
TABLE: list[dict] = []


def measured_step_s(run_dir: Path, last: int = 4) -> float:
    """The median of the last ``last`` steps' wall time in ``run_dir/metrics.jsonl`` (0 before any):
    how fast this machine trains right now. A bound on the flow's own reactions is allowed that
    much more on a busy machine, where the flow process is as slow to act as the ranks to step."""
    import statistics

    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0.0
    times = [json.loads(line)["step_time_s"] for line in path.read_text().splitlines() if '"step_time_s"' in line]
    return statistics.median(times[-last:]) if times else 0.0


# ---------------------------------------------------------------------------------------------
# helpers


def write_campaign(directory: Path, campaign_id: str, *, shard_url: Path, nproc: int = 1,
                   overrides: list[str] | None = None, faults: list[dict] | None = None) -> Path:
    """One stage of STEPS steps of the tiny recipe at one layer; every path under ``directory``."""
    base = ["model.n_layer=1", "data.max_source_bytes=400000", "checkpoint.interval=2",
            "train.log_interval=1", f"reliability.heartbeat_interval_s={INTERVAL_S}",
            "reliability.heartbeat_timeout_s=60"]
    if nproc == 2:
        base.append("train.micro_batch_size=4")  # global batch 8 over 2 data-parallel ranks
    stage = list(overrides or [])
    if faults:
        stage.append("reliability.faults=" + json.dumps(faults))
    doc = {
        "id": campaign_id, "recipe": str(ROOT / "configs/tiny-cpu.yaml"), "nproc_per_node": nproc,
        "root_dir": str(directory / "campaigns"), "shard_url": str(shard_url), "self_check": False,
        "overrides": base, "stages": [{"name": "only", "steps": STEPS, "overrides": stage}],
    }
    path = directory / f"{campaign_id}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


class LogCapture(TimedLogRecords):
    """Every log record of this process (the flow runs in it; rank output arrives as task-run
    records), with its time; ``need`` fails the test naming what is missing."""

    def need(self, pattern: str, after: float = 0.0) -> tuple[float, str]:
        found = self.find(pattern, after)
        assert found is not None, (f"no log record matching {pattern!r} after {after:.3f} among "
                                   f"{len(self.records)}; last: {[m[:120] for _, m in self.records[-3:]]}")
        return found


@pytest.fixture
def logs():
    from prefect.logging.configuration import ensure_logging_setup

    ensure_logging_setup()  # Prefect's first setup replaces the root handlers: ours must come after
    handler = LogCapture()
    logging.getLogger().addHandler(handler)
    yield handler
    logging.getLogger().removeHandler(handler)


@dataclass
class Outcome:
    path: Path
    report: dict
    run_dir: Path
    durable: str

    @property
    def stage(self) -> dict:
        return self.report["stages"][0]


def run_campaign(path: Path) -> Outcome:
    from flows.pretrain import pretrain

    campaign = load_campaign(path)
    report = pretrain(str(path))
    return Outcome(path, report, Path(stage_config(campaign, 0).train.run_dir), campaign.stage_durable_url(0))


def durable_url(directory: Path, campaign_id: str) -> str:
    """A campaign's stage durable URL, known before the campaign file exists (fault targets)."""
    return str(directory / "campaigns" / campaign_id / "durable" / "only")


def fault_time(run_dir: Path, kind: str) -> float:
    markers = list((run_dir / "faults").glob(f"fired-{kind}-*.json"))
    assert markers, f"the {kind} fault never fired (no marker in {run_dir / 'faults'})"
    return min(m.stat().st_mtime for m in markers)


def checkpoint_tensors(durable: str, step: int) -> dict[str, object]:
    step_dir = Path(durable) / step_dir_name(step)
    tensors = {}
    for path in sorted(step_dir.glob("*.safetensors")):
        for name, tensor in load_safetensors(path.read_bytes()).items():
            tensors[f"{path.name}:{name}"] = tensor
    assert tensors, f"{step_dir}: no tensors"
    return tensors


def assert_committed_intact(durable: str, expected: list[int] = COMMITTED) -> None:
    """Exactly the checkpoints retention keeps are committed, and every file of each verifies."""
    infos = catalog.committed(durable)
    assert [info.step for info in infos] == expected
    for info in infos:
        assert verify_checkpoint(info.url, info.manifest) == [], info.url


def assert_bit_exact(durable: str, reference: str, steps: list[int] = COMMITTED) -> None:
    """Weights, optimizer state and RNG of every committed step equal the reference's."""
    for step in steps:
        want, got = checkpoint_tensors(reference, step), checkpoint_tensors(durable, step)
        assert want.keys() == got.keys(), step
        for key in want:
            assert want[key].dtype == got[key].dtype and bool((want[key] == got[key]).all()), (step, key)


def record_row(fault: str, detected_by: str, t_fault: float, t_detect: float, t_recover: float | None,
               outcome: Outcome, bit_exact: bool | None, note: str = "") -> None:
    stage = outcome.stage
    TABLE.append({
        "fault": fault, "detected by": detected_by, "detection_s": round(t_detect - t_fault, 2),
        "recovery_s": None if t_recover is None else round(t_recover - t_fault, 2),
        "attempts": stage["attempts"], "restarts": stage["restarts"], "rollbacks": stage["rollbacks"],
        "bit_exact": bit_exact, "note": note,
    })


def format_table(rows: list[dict]) -> str:
    head = f"| {'fault':<18} | {'detected by':<45} | {'detect s':>8} | {'recover s':>9} | att | rst | rb | bit-exact | note"
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        exact = {True: "yes", False: "no", None: "n/a (math changes)"}[r["bit_exact"]]
        recover = "-" if r["recovery_s"] is None else f"{r['recovery_s']:.2f}"
        lines.append(f"| {r['fault']:<18} | {r['detected by']:<45} | {r['detection_s']:>8.2f} | {recover:>9} | "
                     f"{r['attempts']:>3} | {r['restarts']:>3} | {r['rollbacks']:>2} | {exact} | {r['note']}")
    return "\n".join(lines)


@pytest.fixture(scope="module", autouse=True)
def fault_table(tmp_path_factory):
    """Prints the detection/recovery table after the module (``pytest -s``) and saves it as JSON
    (to ``$MEGATRAIN_FAULT_TABLE`` when set: benchmarks/chaos.py --campaign reads it there)."""
    yield TABLE
    if TABLE:
        out = Path(os.environ.get("MEGATRAIN_FAULT_TABLE") or tmp_path_factory.mktemp("fault-table") / "fault_table.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(TABLE, indent=2))
        print(f"\n\nfault matrix (times from the fault's marker file; {out})\n{format_table(TABLE)}\n")


@pytest.fixture(scope="module", autouse=True)
def reproducible_cpu_math():
    """Pin MKL to one code path (its conditional numerical reproducibility mode) for every rank
    this module starts: with MKL choosing at run time, two runs on this VM once differed in the
    last bits of the first backward (1e-7), which a bit-for-bit comparison rightly catches."""
    before = os.environ.get("MKL_CBWR")
    os.environ["MKL_CBWR"] = before or "AVX2"
    yield
    if before is None:
        os.environ.pop("MKL_CBWR", None)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fault-matrix")


@pytest.fixture(scope="module")
def reference(prefect_api, workdir, shard_root):
    """``reference(nproc)``: the durable URL of a fault-free run of the same campaign on ``nproc``
    ranks (run once per module, on first use)."""
    runs: dict[int, str] = {}

    def get(nproc: int) -> str:
        if nproc not in runs:
            outcome = run_campaign(write_campaign(workdir, f"reference-{nproc}rank", shard_url=shard_root, nproc=nproc))
            assert outcome.stage["attempts"] == 1
            assert_committed_intact(outcome.durable)
            runs[nproc] = outcome.durable
        return runs[nproc]

    return get
