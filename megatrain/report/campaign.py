"""A campaign's report, built from its directory: a row per stage, every fault with the file that
holds its full log, the committed checkpoints, and the pictures (loss curve, straggler heat maps,
who-hung grids, an MoE stage's expert-load heat map), and a few texts sampled from each stage's
final checkpoint (``samples.json`` in the stage's run dir, written by the flow's ``sample-stage`` task).

Two renderings of the same markdown: ``markdown`` for ``report/report.md`` (pictures as files
beside it, logs as paths) and ``ui_markdown`` for the Prefect artifact (pictures inline as data:
URIs, so the UI shows them without a file to follow). No Prefect, no torch: ``tasks/report.py``
publishes it and ``megatrain report CAMPAIGN_DIR`` prints it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from megatrain.checkpoint.files import step_dir_name
from megatrain.report.expert_load import TITLE as EXPERT_LOAD, plot_expert_load
from megatrain.report.records import RESTARTED, human_count, is_fault, is_interrupt, read_stage
from megatrain.report.status import CampaignStatus, campaign_status, describe_data, stage_status
from megatrain.report.runs import markdown_image, plot_loss, summarize_run, tensorboard_problems
from megatrain.report.tb_summary import write_summary_scalars


SAMPLES_FILE = "samples.json"  # [{"prompt", "text", "step"}] in a stage's run dir
SUMMARY_TB = "tb"  # report/tb: the report's numbers as TensorBoard scalars (tb_summary.py)
EXPORT_FILE = "export.json"  # in the final stage's run dir: the export-model task's result (tasks/export.py)


@dataclass
class CampaignReport:
    summary: dict  # report.json: campaign, stages, faults, checkpoints, paths
    markdown: str
    ui_markdown: str
    pictures: dict[str, Path] = field(default_factory=dict)  # title -> PNG


def _round(value, digits: int = 4):
    return None if value is None else round(value, digits)


def build_report(campaign_dir: str | Path, stage_results: list[dict] | None = None) -> CampaignReport:
    """``stage_results``: the flow's ``train-stage`` results, which name its stages in order (and
    hold the attempts as Prefect saw them, for a stage without ``attempts.jsonl``). Everything else
    is read from the campaign folder where it is now: a result's recorded paths (its ``run_dir``,
    ``durable_url``) are never used, since a cached result outlives a move of the folder."""
    campaign_dir = Path(campaign_dir)
    if stage_results:  # the flow's own list of stages: in order, whatever the folders hold
        status = CampaignStatus(campaign_dir.name, str(campaign_dir), [
            stage_status(campaign_dir / r["stage"], target_steps=r.get("steps")) for r in stage_results])
    else:
        status = campaign_status(campaign_dir)
    campaign_dir = Path(status.dir)
    report_dir = campaign_dir / "report"
    report_dir.mkdir(parents=True, exist_ok=True)
    results = {r["stage"]: r for r in stage_results or []}

    rows, attempts_seen, checkpoints, pictures, samples, problems, resumes, restores = [], [], [], {}, {}, [], [], []
    validation = []  # a mixture's stages: each component's validation loss beside the mix
    for stage in status.stages:
        result = results.get(stage.name, {})
        summary = summarize_run(stage.run_dir) if stage.loss is not None else None  # rows to summarize
        # attempts.jsonl (AttemptLog) holds every attempt with its number, reruns of a stopped
        # campaign included; the flow's own history only this run's
        attempts = read_stage(stage.run_dir).attempts  # their logs where they are now
        numbered = ([(a.get("attempt", n), a) for n, a in enumerate(attempts, start=1)] if attempts
                    else list(enumerate(result.get("history") or [], start=1)))
        attempts_seen += [{"stage": stage.name, "attempt": number, "status": attempt.get("status"),
                           "message": attempt.get("message") or "", "log": attempt.get("log") if attempts else None,
                           "fault": is_fault(attempt), "interrupt": is_interrupt(attempt)}
                          for number, attempt in numbered]
        resumes += [{"stage": stage.name, **change} for change in resume_changes(stage.durable_url, stage.committed)]
        restores += [{"stage": stage.name, **row} for row in read_restores(stage.run_dir)]
        rows.append({
            "stage": stage.name, "state": stage.state,
            "steps": stage.last_step,  # the timeline's last step, or the committed one without metrics
            "first loss": _round(summary.first_loss) if summary else None,
            "final loss": _round(stage.loss),
            "val loss": _round(stage.val_loss),
            "tokens": stage.tokens, "tokens/s": None if stage.tokens_per_s is None else round(stage.tokens_per_s),
            "MFU %": None if not summary or summary.mfu is None else round(100 * summary.mfu, 1),
            "step ms": round(summary.step_time_ms, 1) if summary else None,
            **_attempt_counts(stage, [] if attempts else [a for _, a in numbered]),
            "resumed at": stage.resumed_at, "superseded rows": stage.superseded_rows,
            "data": describe_data(stage.data) or None,  # per component: tokens and epochs consumed
        })
        if stage.val_components or stage.validation.get("mixture"):
            validation.append(_validation_row(stage))
        checkpoints += [{"stage": stage.name, "step": step, "url": f"{stage.durable_url.rstrip('/')}/{step_dir_name(step)}"}
                        for step in stage.committed]
        samples[stage.name] = _read_samples(Path(stage.run_dir) / SAMPLES_FILE)
        found = stage.notes + _tensorboard_problems(stage)
        if found:
            problems.append({"stage": stage.name, "problems": found})
        for png in sorted(Path(stage.run_dir).glob("stragglers.png")) + sorted(Path(stage.run_dir).glob("hang-attempt*.png")):
            kind = "straggler heat map" if png.name == "stragglers.png" else f"who hung ({png.stem})"
            pictures[f"{stage.name}: {kind}"] = png
        # drawn here, from metrics.jsonl: the report's own picture, also of a stage still running
        expert_png = plot_expert_load(stage.run_dir, report_dir / f"expert-load-{stage.name}.png",
                                      title=f"stage {stage.name}")
        if expert_png is not None:
            pictures[f"{stage.name}: {EXPERT_LOAD}"] = expert_png

    loss_png = plot_loss({s.name: s.run_dir for s in status.stages}, report_dir / "loss.png",
                         title=f"campaign {status.id}: loss per stage")
    pictures = {"loss curve": loss_png, **pictures}
    # event files in <stage run dir>/tb (megatrain/observe/tensorboard.py): one logdir for all stages
    tensorboard = campaign_dir if any((Path(s.run_dir) / "tb").is_dir() for s in status.stages) else None
    summary = {
        "campaign": status.id, "campaign_dir": str(campaign_dir), "finished": status.finished,
        "stages": rows, "attempts": attempts_seen, "checkpoints": checkpoints,
        "faults": [a for a in attempts_seen if a["fault"]],
        "interrupts": [a for a in attempts_seen if a["interrupt"]],  # a Ctrl-C, a SIGTERM, a cancel: not faults
        "report": str(report_dir / "report.md"), "loss_curve": str(loss_png),
        "tensorboard": str(tensorboard) if tensorboard else None,
        "pictures": {title: str(png) for title, png in pictures.items()},
        "samples": samples,
        "resume_changes": resumes,  # schedule or layout changed on a resume (the checkpoint history)
        "restores": restores,  # every restore of a restarted attempt: its tier (keeper, peer, durable) and cost
        "problems": problems,  # files missing or damaged, per stage
        "validation": validation,  # per stage of a mixture: the mix, its weights, each component's loss or reason
        "export": _read_export(status.stages[-1].run_dir) if status.stages else None,
    }
    if tensorboard:  # the same numbers in TensorBoard, beside the stages' curves
        summary["tensorboard_summary"] = str(write_summary_scalars(summary, report_dir / SUMMARY_TB))
    head, body = _markdown_body(summary)

    def with_pictures(show) -> str:
        # the loss curve right under the stage table, where a reader (and a screenshot) sees it first
        shown = [f"## {title}\n\n{show(png, title)}\n" for title, png in pictures.items()]
        return "\n".join([head, shown[0], body, *shown[1:]])

    files = with_pictures(lambda png, title: f"![{title}]({_relative(png, report_dir)})")
    return CampaignReport(summary, files, with_pictures(markdown_image), pictures)


def _attempt_counts(stage, history: list[dict]) -> dict:
    """How the stage's attempts ended: its records' counts (``megatrain status`` shows the same);
    a stage without ``attempts.jsonl`` counts the flow's history of it instead."""
    if not history:
        return {"attempts": stage.attempts, "restarts": stage.restarts, "rollbacks": stage.rollbacks,
                "interrupts": stage.interrupts, "faults": stage.faults}
    return {"attempts": len(history), "restarts": sum(a.get("status") in RESTARTED for a in history),
            "rollbacks": max(stage.rollbacks, sum(a.get("status") == "anomaly" for a in history)),
            "interrupts": sum(map(is_interrupt, history)), "faults": sum(map(is_fault, history))}


def _validation_row(stage) -> dict:
    """A stage's validation by component: the mix (val_loss) and, per component, its loss, its
    weight in the mix, its held-out samples and documents, and why it has none (validation.json)."""
    record = stage.validation
    components = {}
    for name in dict.fromkeys([*stage.val_components, *record.get("components", {})]):
        held = record.get("components", {}).get(name) or {}
        components[name] = {"val loss": _round(stage.val_components.get(name)),
                            "weight": _round((record.get("weights") or {}).get(name)),
                            "samples": held.get("samples"), "documents": held.get("documents"),
                            "note": held.get("note") or ""}
    return {"stage": stage.name, "val loss": _round(stage.val_loss), "weights from": record.get("source"),
            "components": components}


def _validation_markdown(validation: list[dict]) -> list[str]:
    if not validation:
        return []
    lines = ["", "## Validation by component", "",
             "`val loss` is the mix of the components' held-out losses under the validation weights.", "",
             "| stage | component | val loss | weight in the mix | held-out samples | documents | note |",
             "|---|---|---|---|---|---|---|"]
    for row in validation:
        lines.append(f"| {row['stage']} | **mix** | {'-' if row['val loss'] is None else row['val loss']} | "
                     f"{row['weights from'] or '-'} | | | |")
        for name, c in row["components"].items():
            cells = [c["val loss"], c["weight"], c["samples"], c["documents"]]
            lines.append(f"| {row['stage']} | {name} | " + " | ".join("-" if v is None else str(v) for v in cells)
                         + f" | {c['note'].replace('|', '/')} |")
    return lines


def _tensorboard_problems(stage) -> list[str]:
    """A stage that trained with TensorBoard on (its config.yaml) and has no whole event file: named.
    A running stage's writer may be mid-flush, so it is looked at once it has ended."""
    from megatrain.config.run_dirs import read_run_dir

    run = read_run_dir(stage.run_dir)  # its TensorBoard dir where it lies now, also in a moved campaign
    train = run.located().get("train", {}) if run is not None else {}
    if stage.state in ("running", "pending") or not stage.last_step or not train.get("tensorboard", True):
        return []
    return tensorboard_problems(train.get("tensorboard_dir") or Path(stage.run_dir) / "tb")


def _read_samples(path: Path) -> list[dict]:
    """The stage's samples; none when the file is missing or unreadable (the report says so)."""
    import json

    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    return [s for s in found if isinstance(s, dict) and {"prompt", "text"} <= s.keys()] if isinstance(found, list) else []


def _read_export(run_dir: str | Path) -> dict | None:
    """The final stage's export.json, its model's path where the folder is now."""
    import json

    try:
        found = json.loads((Path(run_dir) / EXPORT_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(found, dict) or "exported" not in found:
        return None
    if found.get("path"):
        found["path"] = read_stage(run_dir).where(str(found["path"]))
    return found


def _export_markdown(export: dict | None) -> list[str]:
    """The final model: where it is and how transformers reads it, or why there is none."""
    if export is None:
        return []
    if not export["exported"]:
        return ["", "## Final model", "", f"Not exported: {export['reason']}"]
    lines = ["", "## Final model", "",
             f"`{export['path']}`: {export['architecture']}, step {export['step']}; "
             f"`transformers.AutoModelForCausalLM.from_pretrained(...)` loads it, its logits within "
             f"{export['max_logit_diff']:.1e} of megatrain's (fp32).", "",
             "Greedy samples, transformers' token ids against megatrain's:", ""]
    for sample in export.get("samples", []):
        lines += _export_sample(sample)
    return lines


def _export_sample(sample: dict) -> list[str]:
    """One greedy sample of the export check (evaluate/exported.py): "same" when the generated ids
    are, else both texts; older export.json files, without ids, compare their texts."""
    def indent(text: str) -> list[str]:
        return ["    " + line for line in text.splitlines()]

    same = sample.get("same", sample["transformers"] == sample["megatrain"])
    if same:
        lines = [f"* `{sample['prompt']}`: same", "", *indent(sample["megatrain"]), ""]
    else:
        at = sample.get("first_difference")
        lines = [f"* `{sample['prompt']}`: DIFFERENT" + (f" from generated token {at}" if at is not None else ""), "",
                 "  megatrain:", "", *indent(sample["megatrain"]), "", "  transformers:", "",
                 *indent(sample["transformers"]), ""]
    if sample.get("tokenizer_same") is False:
        lines += [f"  transformers' tokenizer encodes this prompt as {sample.get('transformers_prompt_ids')}, "
                  f"the run's documents started as {sample.get('prompt_ids')}", ""]
    return lines


def resume_changes(durable_url: str, committed: list[int]) -> list[dict]:
    """The checkpoint history of a stage's newest committed step: each resume that changed the
    schedule (with the LR at that step before and after) or the layout. Empty when nothing
    changed, or when the checkpoint cannot be read (the report is no place to fail)."""
    import json

    from megatrain import storage
    from megatrain.checkpoint.files import rank_meta_file

    if not committed:
        return []
    step_url = f"{durable_url.rstrip('/')}/{step_dir_name(max(committed))}"
    try:
        meta = json.loads(storage.read_bytes(storage.confined(step_url, rank_meta_file(0), step_url)))
    except (OSError, ValueError):
        return []
    return [entry for entry in meta.get("history") or [] if isinstance(entry, dict) and "step" in entry]


RESTORES_FILE = "restores.jsonl"  # in a stage's run dir: a row per restore (megatrain/checkpoint/manager.py)


def read_restores(run_dir: str | Path) -> list[dict]:
    """A stage's restores, in order: step, tier, seconds, the newest durable step then (a torn
    row is skipped: the report is no place to fail)."""
    from megatrain.report.runs import read_jsonl

    return [{k: row.get(k) for k in ("step", "tier", "seconds", "durable_step", "world_size")}
            for row in read_jsonl(Path(run_dir) / RESTORES_FILE).rows if isinstance(row.get("step"), int)]


def _restores_markdown(restores: list[dict]) -> list[str]:
    """A line per restore: where it came from and what it cost (seconds; the steps it kept over the
    durable store, which a durable restore would have redone)."""
    if not restores:
        return []
    lines = ["", "## Restores", ""]
    for row in restores:
        seconds = "-" if row.get("seconds") is None else f"{row['seconds']:.3f} s"
        durable = row.get("durable_step")
        newer = None if durable is None or row["tier"] == "durable" else row["step"] - durable
        ahead = "" if newer is None else f", {newer} step{'' if newer == 1 else 's'} newer"
        lines.append(f"* `{row['stage']}` restored step {row['step']} from the **{row['tier']}** tier in {seconds} "
                     f"(newest durable step {'-' if durable is None else durable}{ahead})")
    return lines


def _resume_changes_markdown(changes: list[dict]) -> list[str]:
    if not changes:
        return []
    lines = ["", "## Changes on resume", ""]
    for change in changes:
        said = []
        if change.get("schedule"):
            said.append("schedule " + ", ".join(f"`{name}` {old} -> {new}" for name, (old, new) in change["schedule"].items()))
        if change.get("lr") and None not in change["lr"]:
            said.append("LR {:.3e} -> {:.3e}".format(*change["lr"]))
        if change.get("layout"):
            before, after = change["layout"]
            said.append(f"layout {_layout(before)} -> {_layout(after)}")
        lines.append(f"* `{change['stage']}` resumed at step {change['step']}: " + "; ".join(said))
    return lines


def _layout(layout: dict) -> str:
    return " ".join(f"{k}={layout[k]}" for k in ("dp", "tp", "pp", "zero_stage") if k in layout)


def _samples_markdown(samples: dict[str, list[dict]]) -> list[str]:
    lines = ["", "## Samples", ""]
    for stage, found in samples.items():
        if not found:
            lines += [f"`{stage}`: no samples (see the `sample-stage` task run)", ""]
            continue
        lines += [f"`{stage}`, step {found[0].get('step', '-')} (seed 0, temperature 0.8, top-k 50):", ""]
        for sample in found:  # indented: a code block that markdown renders as written
            text = sample["text"]  # the prompt and its completion
            lines += ["    " + line for line in text.splitlines() or [""]] + [""]
    return lines


def _relative(path: Path, start: Path) -> str:
    try:
        return str(path.relative_to(start))
    except ValueError:
        import os

        return os.path.relpath(path, start)


def _markdown_body(summary: dict) -> tuple[str, str]:
    """The report's text in two parts: its title and stage table, and the rest."""
    columns = ["stage", "state", "steps", "final loss", "val loss", "tokens", "tokens/s", "attempts", "restarts",
               "rollbacks", "interrupts", "data"]
    shown = {"tokens": lambda v: human_count(v), "tokens/s": lambda v: f"{v:,}"}
    lines = [f"# Campaign `{summary['campaign']}`", "",
             "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join("-" if row.get(c) is None else shown.get(c, str)(row[c]) for c in columns) + " |"
              for row in summary["stages"]]
    redone = sum(row.get("superseded rows") or 0 for row in summary["stages"])
    lines += ["", "tokens/s: the tokens of the steps that led to the final model over the time those steps took"
              + (f" ({redone} logged rows of steps trained again after a restart, rollback or interrupt left out)."
                 if redone else ".")]
    head, lines = "\n".join(lines) + "\n", []
    lines += [f"## Attempts ({len(summary['faults'])} faults detected, "
              f"{len(summary.get('interrupts') or [])} interrupts)", ""]
    lines += [f"* `{a['stage']}` attempt {a['attempt']}: **{a['status']}**" + (f": {a['message']}" if a["message"] else "")
              + (f" (full log: `{a['log']}`)" if a.get("log") else "") for a in summary["attempts"]]
    newest = summary["checkpoints"][-1]["url"] if summary["checkpoints"] else "-"
    lines += ["", f"Checkpoints: {len(summary['checkpoints'])} committed, newest `{newest}`",
              f"(`megatrain checkpoints verify {summary['campaign_dir']}`)."]
    if summary["tensorboard"]:
        lines.append(f"TensorBoard: `tensorboard --logdir {summary['tensorboard']}`.")
    if summary.get("problems"):
        lines += ["", "## Missing or damaged files", ""]
        lines += [f"* `{p['stage']}`: {problem}" for p in summary["problems"] for problem in p["problems"]]
    lines += _validation_markdown(summary.get("validation") or [])
    lines += _restores_markdown(summary.get("restores") or [])
    lines += _resume_changes_markdown(summary.get("resume_changes") or [])
    lines += _samples_markdown(summary["samples"])
    lines += _export_markdown(summary.get("export"))
    return head, "\n".join(lines) + "\n"
