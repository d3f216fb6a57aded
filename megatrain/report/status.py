"""Where a campaign stands, read from its directory alone (no Prefect, no torch).

A campaign dir (``runs/campaigns/<id>/``) holds one folder per stage with the stage's run config
(``config.yaml``), its ``metrics.jsonl``, ``attempts.jsonl`` (one row per ended attempt, written by
``megatrain.observe.attempt_log``) and ``rollbacks.json``; committed checkpoints sit under the
stage's ``checkpoint.durable_url``. Stages are ordered by their ``checkpoint.init_from`` chain
(each stage starts from the previous one's durable URL).

A stage's state:

- ``done``: its final step is committed.
- ``running``: a live process works on it. Known from leases, not from how recent a file is: rank
  0 holds ``<stage>/lease.json`` while the ranks train, the flow holds ``<campaign>/lease.json``
  for its whole run (starting ranks, restarting them, uploading). A holder on this host is alive
  exactly while its pid is (with the same start time), however long a step, an evaluation or a
  save keeps the files quiet, and dead the moment it is killed; one on another host counts while
  its heartbeat is fresh. (A fresh ``metrics.jsonl`` said "running" for two minutes after a
  stage had failed; a quiet one said "stopped" in the middle of a long step.) A campaign whose
  lease is in Redis (``reliability.redis_url``) shows only its ranks' lease.
- ``failed``: the flow gave up on it, as ``tasks/train.py`` does with the attempts it records:
  the last attempt ended ``deterministic``, the restarts or rollbacks were used up, the flow
  stopped the ranks because the stage failed (an upload that failed for good), or the ranks
  finished without a committed final step. ``last_fault`` says why.
- ``stopped``: it trained, nothing works on it, and the flow did not give up (a signal, a cancel,
  a killed flow process): a rerun resumes it.
- ``pending``: nothing trained yet.

A missing or damaged ``metrics.jsonl`` is named in ``notes`` (the steps then come from the
committed checkpoints), never read as "no progress".

Used by ``megatrain status``, ``megatrain report CAMPAIGN_DIR``, ``megatrain checkpoints`` on a
campaign dir, and ``python -m flows.pretrain`` to say that a campaign is already finished.
"""

from __future__ import annotations

import json
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from megatrain.config.campaign import DEFAULT_ROOT, find_campaign_dir, stage_dirs
from megatrain.config.run_dirs import is_stage_dir, read_run_dir
from megatrain.errors import InputError
from megatrain.report.records import RESTARTED, human_count, is_fault, read_stage

# How old a lease's heartbeat may be before a holder on another host counts as gone: the
# holders' own limits (rank 0: ``Lease``'s default; the flow: ``flows.lifecycle.LEASE_STALE_S``).
RANK_LEASE_STALE_S = 60.0
FLOW_LEASE_STALE_S = 120.0
LEASE_FILE = "lease.json"  # megatrain.launch.lease.LEASE_FILE (report does not import launch: layers)


@dataclass
class StageStatus:
    name: str
    state: str  # done | running | failed | stopped | pending
    target_steps: int
    last_step: int = 0
    loss: float | None = None
    val_loss: float | None = None  # the last logged validation loss, when the run evaluates
    tokens_per_s: float | None = None  # tokens / train seconds of the stage's timeline (``records``)
    tokens: int = 0  # the tokens of the timeline's steps (redone steps not counted)
    attempts: int = 0
    restarts: int = 0
    rollbacks: int = 0
    faults: int = 0  # attempts that ended in a fault (``records.is_fault``)
    interrupts: int = 0  # attempts stopped by a signal or a cancel: not faults
    resumed_at: list[int] = field(default_factory=list)  # the steps attempts resumed from
    superseded_rows: int = 0  # metrics rows of steps trained again (not in the timeline)
    committed: list[int] = field(default_factory=list)
    last_fault: str | None = None
    run_dir: str = ""
    durable_url: str = ""
    logs: list[str] = field(default_factory=list)
    data: dict[str, dict] = field(default_factory=dict)  # per data component: samples, tokens, epochs so far
    # a mixture's validation: each component's last held-out loss (val_loss is their mix), and
    # validation.json's record (the mix's weights and source, each component's samples and note)
    val_components: dict[str, float] = field(default_factory=dict)
    validation: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # files missing or damaged: "metrics.jsonl missing"


VALIDATION_FILE = "validation.json"  # megatrain.evaluate.validation_sets.VALIDATION_FILE (report does not import it)
VAL_PREFIX = "val_loss/"  # a metrics row's per-component validation loss: val_loss/<component>


def describe_validation(stage: StageStatus) -> str:
    """``code 5.312 (w 0.75), web 4.981 (w 0.25); books: none: <why>``: each component's last
    validation loss and its weight in the mix (val_loss), and a component without held-out
    samples with its reason, in one line."""
    components = stage.validation.get("components", {})
    weights = stage.validation.get("weights", {})
    names = list(dict.fromkeys([*stage.val_components, *components]))
    shown, missing = [], []
    for name in names:
        if name in stage.val_components:
            weight = f" (w {weights[name]:.3g})" if name in weights else " (outside the mix)"
            shown.append(f"{name} {stage.val_components[name]:.4f}{weight}")
        elif not (components.get(name) or {}).get("samples"):
            missing.append(f"{name}: none: {(components.get(name) or {}).get('note') or 'no held-out samples'}")
    return "; ".join(filter(None, [", ".join(shown), *missing]))


def _read_validation(stage_dir: Path) -> dict:
    try:
        found = json.loads((stage_dir / VALIDATION_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def describe_data(data: dict[str, dict]) -> str:
    """``web 1.23M tok 0 ep (samples 0-9,599), code 32.9k tok 1 ep (samples 2,400-2,655)``: what
    each data component fed so far, and which of its own samples (earlier stages' before them)."""
    return ", ".join(f"{name} {human_count(stats['tokens'])} tok {int(stats['epochs'])} ep{_sample_range(stats)}"
                     for name, stats in data.items())


def _sample_range(stats: dict) -> str:
    """`` (samples 768-1,023)``: the component's own samples this stage served (none: no range)."""
    if "samples" not in stats:
        return ""
    first, count = int(stats.get("start", 0)), int(stats["samples"])
    return f" (samples {first:,}-{first + count - 1:,})" if count else " (no samples)"


@dataclass
class CampaignStatus:
    id: str
    dir: str
    stages: list[StageStatus]
    kind: str = "campaign"  # or "run": a run dir of its own (``run_status``), shown as one stage

    @property
    def finished(self) -> bool:
        return all(s.state == "done" for s in self.stages)

    def as_dict(self) -> dict:
        return {"id": self.id, "kind": self.kind, "dir": self.dir, "finished": self.finished,
                "stages": [asdict(s) for s in self.stages]}


@dataclass
class Holder:
    """The process a lease file names, and whether it still runs."""
    owner: str
    pid: int
    host: str
    started: float
    alive: bool

    def describe(self) -> str:
        return f"{self.owner} (pid {self.pid} on {self.host})"


def _process_start(pid: int) -> str | None:
    """The start time of a running ``pid`` (None: no such process, or a zombie), as
    ``megatrain.launch.lease`` records it: tells its holder from a process reusing its pid."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


def lease_holder(directory: str | Path, stale_after_s: float) -> Holder | None:
    """Who holds (or held: ``alive`` False) the lease in ``directory``; None when there is none."""
    try:
        record = json.loads((Path(directory) / LEASE_FILE).read_text())
        holder = Holder(str(record["owner"]), int(record["pid"]), str(record["host"]), float(record["started"]), False)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if holder.host == socket.gethostname():
        start = _process_start(holder.pid)
        holder.alive = start is not None and record.get("pid_start") in (None, start)
    else:
        holder.alive = time.time() - float(record.get("heartbeat") or 0) < stale_after_s
    return holder


def _last_fault(attempts: list[dict], rollbacks: list[dict]) -> str | None:
    faults = [a for a in attempts if is_fault(a)]  # a Ctrl-C is an interrupt, not a fault
    if faults:
        last = faults[-1]
        return f"attempt {last['attempt']} {last['status']}: {last.get('message') or ''}".strip()
    if rollbacks:
        last = rollbacks[-1]
        return f"{last['kind']} at step {last['anomaly_step']} -> rolled back to step {last['restore_step']}"
    return None


def _gave_up(attempts: list[dict], rollbacks: list[dict], cfg: dict) -> str | None:
    """Why the flow failed the stage at once after its last attempt (``tasks/train.py``'s rules,
    on what it recorded), or None when it would go on: restart, roll back, or (stopped) resume."""
    last = attempts[-1]
    status, message = last.get("status"), last.get("message") or ""
    policy = cfg.get("reliability", {})
    if status == "deterministic":
        return f"attempt {last['attempt']} deterministic: {message}"
    if status in RESTARTED:
        starts = [i for i, a in enumerate(attempts) if a.get("attempt") == 1]  # each flow run counts from 1
        this_run = attempts[starts[-1] if starts else 0:]
        limit = int(policy.get("max_restarts", 3))
        if sum(a.get("status") in RESTARTED for a in this_run) > limit:
            return f"{limit} restarts used up; attempt {last['attempt']} {status}: {message}"
    if status == "anomaly":
        verdict = last.get("verdict") or {}
        step = verdict.get("step")
        window, limit = int(policy.get("rollback_window_steps", 1000)), int(policy.get("max_rollbacks", 3))
        recent = [r for r in rollbacks if step is not None and step - r.get("anomaly_step", 0) < window]
        if step is not None and not any(r.get("anomaly_step") == step for r in rollbacks) and len(recent) >= limit:
            return (f"{len(recent) + 1} anomalies within {window} steps (limit {limit}); "
                    f"last: {verdict.get('message') or message}")
    if status == "stopped" and "the stage failed" in message:  # the flow stops the ranks of a failed stage
        from megatrain.checkpoint.upload import ready_steps

        staging = cfg.get("checkpoint", {}).get("staging_dir")
        staged = ready_steps(staging) if staging else []
        return (f"the flow failed the stage during attempt {last['attempt']}"
                + (f": staged step(s) {staged} never committed (an upload that failed for good)" if staged else ""))
    return None


def _notes(metrics, attempts: list[dict], steps: list[int], live: bool) -> list[str]:
    """What is wrong with the stage's metrics.jsonl (``runs.JsonlFile``): missing after rows were
    written or checkpoints committed, fewer rows than an attempt counted, a torn line."""
    written = max((int(a.get("metrics_rows") or 0) for a in attempts), default=0)  # rows only grow
    if not metrics.exists:
        return ["metrics.jsonl missing"] if steps or written else []
    notes = metrics.problems(live)
    if len(metrics.rows) < written:
        notes.append(f"metrics.jsonl has {len(metrics.rows)} rows, {written} when an attempt ended (cut short)")
    return notes


def stage_status(stage_dir: Path, durable_url: str | None = None, target_steps: int | None = None,
                 flow: Holder | None = None) -> StageStatus:
    """One stage from its folder; ``durable_url`` and ``target_steps`` default to its config.yaml's.
    ``flow``: the campaign's lease holder when this is the stage its flow works on (the first one
    not done), else None."""
    from megatrain.checkpoint.catalog import committed
    from megatrain.report.runs import read_jsonl

    stage_dir = Path(stage_dir)
    metrics = read_jsonl(stage_dir / "metrics.jsonl")
    records = read_stage(stage_dir, metrics.rows)  # the one reading of its rows, attempts and rollbacks
    run = records.run
    cfg = run.located() if run else {}
    target = target_steps or int(cfg.get("train", {}).get("steps", 0))
    # where the stage's checkpoints are now: never a stored absolute path (a moved or copied campaign)
    durable = durable_url or records.where(str(cfg.get("checkpoint", {}).get("durable_url", "")))
    rows = records.timeline
    attempts, rollbacks = records.attempts, records.rollbacks
    steps = [info.step for info in committed(durable)] if durable else []
    val = [r for r in rows if r.get("val_loss") is not None]
    by_component = next(({k[len(VAL_PREFIX):]: v for k, v in r.items() if k.startswith(VAL_PREFIX)}
                         for r in reversed(rows) if any(k.startswith(VAL_PREFIX) for k in r)), {})

    state, fault = _state(stage_dir, target, steps, attempts, rollbacks, cfg, flow, trained=bool(rows))
    return StageStatus(
        name=stage_dir.name, state=state, target_steps=target,
        # a deleted or cut metrics file loses no progress: the committed steps still say how far it got
        last_step=max([rows[-1]["step"] if rows else 0, *steps[-1:]]),
        loss=rows[-1].get("loss") if rows else None,
        val_loss=val[-1]["val_loss"] if val else None,
        tokens_per_s=records.tokens_per_s, tokens=records.tokens,
        attempts=records.attempt_count, restarts=records.restarts, rollbacks=len(rollbacks),
        faults=len(records.faults), interrupts=len(records.interrupts),
        resumed_at=[r.step for r in records.resumes], superseded_rows=len(records.superseded),
        committed=steps, last_fault=fault or _last_fault(attempts, rollbacks),
        run_dir=str(stage_dir), durable_url=durable,
        logs=[a["log"] for a in attempts if a.get("log")],
        data=next((r["data"] for r in reversed(rows) if r.get("data")), {}),
        val_components=by_component, validation=_read_validation(stage_dir),
        notes=_notes(metrics, attempts, steps, live=state == "running"),
    )


def _state(stage_dir: Path, target: int, steps: list[int], attempts: list[dict], rollbacks: list[dict],
           cfg: dict, flow: Holder | None, trained: bool) -> tuple[str, str | None]:
    """(state, its cause when that is not the last attempt's fault); see the module docstring."""
    if target and target in steps:
        return "done", None
    last = attempts[-1] if attempts else None
    ended = float(last.get("ended") or 0) if last else 0.0
    ranks = lease_holder(stage_dir, RANK_LEASE_STALE_S)
    # an attempt's rank 0 takes the lease after the previous attempt ended; an older live holder
    # is someone else's run in this folder (``megatrain train`` by hand), not this stage's attempt
    if ranks is not None and ranks.alive and ranks.started > ended:
        return "running", None
    gave_up = _gave_up(attempts, rollbacks, cfg) if last else None
    # a flow run that began after the attempt that made it give up is a rerun working on the stage
    rerun = flow is not None and flow.alive and flow.started > ended
    if gave_up and not rerun:
        return "failed", gave_up
    if flow is not None and flow.alive:
        return "running", None
    if last is not None and last.get("status") == "completed":  # the flow checks the final step last
        return "failed", f"the ranks finished but final step {target} is not committed"
    if not (attempts or trained or steps):
        return "pending", None
    if flow is not None:  # the lease is still there, its holder is not: the flow process was killed
        fault = _last_fault(attempts, rollbacks)
        return "stopped", f"its flow process died: {flow.describe()}" + (f"; before that {fault}" if fault else "")
    return "stopped", None


def campaign_status(target: str | Path, root: str | Path | None = None) -> CampaignStatus:
    campaign_dir = find_campaign_dir(target, root)
    flow = lease_holder(campaign_dir, FLOW_LEASE_STALE_S)
    stages = []
    for stage_dir in stage_dirs(campaign_dir):  # the flow trains them in order: it works on the first not done
        working_on = all(s.state == "done" for s in stages)
        stages.append(stage_status(stage_dir, flow=flow if working_on else None))
    return CampaignStatus(id=campaign_dir.name, dir=str(campaign_dir), stages=stages)


def run_status(run_dir: str | Path) -> CampaignStatus:
    """A run dir that is no campaign's stage (``megatrain train``'s), shown as a campaign of one stage."""
    path = Path(run_dir).resolve()
    return CampaignStatus(id=path.name, dir=str(path), stages=[stage_status(path)], kind="run")


def find_status(target: str | Path, root: str | Path | None = None) -> CampaignStatus:
    """What ``megatrain status`` shows for ``target``: a campaign dir or id (under ``root``), a
    campaign's stage dir (its campaign), or a run dir (that run). Raises InputError, one line
    naming ``target``, when it is none of these."""
    if read_run_dir(target) is not None and not is_stage_dir(target):
        return run_status(target)
    try:
        return campaign_status(target, root)
    except FileNotFoundError:
        raise InputError(f"{target}: not a run dir (no run.json or config.yaml), nor a campaign dir (stage folders "
                         f"with config.yaml) or a stage dir in one, and no campaign of that id under "
                         f"{root or DEFAULT_ROOT}") from None


def describe_attempts(stage) -> str:
    """``1 restarts, 1 rollbacks, 1 interrupts``: how a stage's attempts ended, other than done."""
    return f"{stage.restarts} restarts, {stage.rollbacks} rollbacks, {stage.interrupts} interrupts"


def step_text(stage: StageStatus) -> str:
    """``40/40``, or ``40/40 (metrics.jsonl missing)`` when a file is missing or damaged."""
    return f"{stage.last_step}/{stage.target_steps}" + (f" ({'; '.join(stage.notes)})" if stage.notes else "")


def cli(argv: list[str]) -> int:
    """``megatrain status TARGET [--json]``: a campaign dir or id (under ``--root``), a stage dir, a run dir."""
    import argparse

    parser = argparse.ArgumentParser(prog="megatrain status", description="Where a campaign stands, at a glance.")
    parser.add_argument("campaign", help="a campaign dir (runs/campaigns/<id>), a stage dir in one, a campaign id, "
                        "or a run dir")
    parser.add_argument("--root", default=None, help=f"where campaign ids live (default {DEFAULT_ROOT})")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(argv)
    status = find_status(args.campaign, args.root)  # none of these: InputError, one line from megatrain.cli
    if args.json:
        print(json.dumps(status.as_dict(), indent=2))
        return 0
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=f"{status.kind} {status.id} ({'finished' if status.finished else 'not finished'})",
                  caption=status.dir)
    for column in ("stage", "state", "step", "loss", "val loss", "tokens", "tokens/s", "data", "attempts", "checkpoints",
                   "last fault"):
        table.add_column(column, justify="right" if column in ("step", "loss", "val loss", "tokens", "tokens/s",
                                                               "attempts") else "left", overflow="fold")
    mixture = any(s.val_components or s.validation.get("mixture") for s in status.stages)
    if mixture:  # a mixture's validation: each component's loss beside the mix (val loss)
        table.add_column("val by component", overflow="fold")
    colors = {"done": "green", "running": "cyan", "failed": "red", "stopped": "yellow", "pending": "dim"}
    for stage in status.stages:
        table.add_row(
            escape(stage.name), f"[{colors[stage.state]}]{stage.state}[/]", escape(step_text(stage)),
            "-" if stage.loss is None else f"{stage.loss:.4f}", "-" if stage.val_loss is None else f"{stage.val_loss:.4f}",
            human_count(stage.tokens) if stage.tokens else "-",
            "-" if stage.tokens_per_s is None else f"{stage.tokens_per_s:,.0f}", escape(describe_data(stage.data) or "-"),
            f"{stage.attempts} ({describe_attempts(stage)})",
            ", ".join(map(str, stage.committed)) or "-", escape(stage.last_fault or "-"),
            *([escape(describe_validation(stage) or "-")] if mixture else []),
        )
    import sys

    (Console() if sys.stdout.isatty() else Console(width=160)).print(table)
    return 0
