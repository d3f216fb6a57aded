"""``megatrain checkpoints list|verify|inspect URL``: look at a durable checkpoint URL.

- ``list URL``: every step directory with committed?, size and file count;
- ``verify URL [--step N]``: re-hash every file of the committed checkpoints (or one) against its
  manifest; exit 1 naming each bad file;
- ``inspect URL [--step N]``: the manifest of the newest committed checkpoint (or step N), once it
  verifies.

A step asked for by itself (``--step N``, or a step dir URL) that is not committed (no manifest,
one that does not parse) or does not verify is one line on stderr saying so and why, and exit 1:
never a manifest printed for files that restore would refuse.

URL is the ``checkpoint.durable_url`` of a run (any fsspec URL); it may also name one step dir,
or a campaign dir (or its ``durable`` dir): then each stage's checkpoints, stage by stage.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from megatrain import storage
from megatrain.checkpoint import catalog
from megatrain.checkpoint.files import parse_step
from megatrain.checkpoint.restore import verify_checkpoint
from megatrain.config.run_dirs import read_run_dir
from megatrain.config.campaign import find_campaign_dir, stage_dirs


def _checkpoints(url: str) -> list[catalog.CheckpointInfo]:
    """The checkpoints under a durable root, or the one a step-dir URL names."""
    step = parse_step(url)
    if step is not None:
        root = storage.parent_url(url)
        return [info for info in catalog.list_checkpoints(root) if info.step == step]
    return catalog.list_checkpoints(url)


def _human(size: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return ""


def cmd_list(url: str) -> int:
    infos = _checkpoints(url)
    if not infos:
        print(f"{url}: no checkpoints")
        return 0
    print(f"{'step':>10}  {'committed':<9}  {'size':>9}  {'files':>5}  url")
    for info in infos:
        note = f"  ({info.problem})" if info.problem else ""
        print(f"{info.step:>10}  {'yes' if info.committed else 'no':<9}  {_human(info.size_bytes):>9}  {info.files:>5}  {info.url}{note}")
    return 0


def _select(url: str, step: int | None) -> list[catalog.CheckpointInfo] | str:
    committed = [info for info in _checkpoints(url) if info.committed]
    if step is not None:
        committed = [info for info in committed if info.step == step]
    return committed or (f"{url}: no committed checkpoint" + (f" at step {step}" if step is not None else ""))


def _verified_step(url: str, step: int) -> tuple[catalog.CheckpointInfo | None, str | None]:
    """(``step`` under ``url``, None) when it is committed and verifies, else (None, one line
    saying why not)."""
    found = [info for info in _checkpoints(url) if info.step == step]
    if not found:
        return None, f"step {step} is not committed: there is no such step under {url}"
    info = found[0]
    if info.problem:
        return None, f"step {step} at {info.url} is not committed: its manifest is unreadable ({info.problem})"
    if not info.committed:
        return None, (f"step {step} at {info.url} is not committed: it has no manifest.json (an upload that "
                      f"never finished; {info.files} files so far)")
    problems = verify_checkpoint(info.url, info.manifest)
    if problems:
        return None, (f"step {step} at {info.url} does not verify, so it counts as not committed: "
                      f"{len(problems)} problem(s): {'; '.join(problems)}")
    return info, None


def _one_line(problem: str) -> int:
    print(f"megatrain checkpoints: {' '.join(problem.split())}", file=sys.stderr)
    return 1


def cmd_verify(url: str, step: int | None) -> int:
    """Re-hash and parse every committed step; a manifest that does not parse (or names a file
    outside its step) is as corrupt as a bad file. Ends with the step restore would use."""
    asked = step if step is not None else parse_step(url)
    if asked is not None:  # one step: committed and verified, or one line saying why not
        info, problem = _verified_step(url, asked)
        if problem:
            return _one_line(problem)
        print(f"step {asked}: ok ({info.files} files, {_human(info.size_bytes)})")
        return 0
    unreadable = [info for info in _checkpoints(url) if info.problem]
    selected = _select(url, None)
    if isinstance(selected, str) and not unreadable:
        print(selected, file=sys.stderr)
        return 1
    verdicts = {info.step: (info, [info.problem]) for info in unreadable}
    for info in selected if not isinstance(selected, str) else []:
        verdicts[info.step] = (info, verify_checkpoint(info.url, info.manifest))
    for number, (info, problems) in sorted(verdicts.items()):
        if problems:
            print(f"step {number}: CORRUPT")
            for problem in problems:
                print(f"  {problem}")
        else:
            print(f"step {number}: ok ({info.files} files, {_human(info.size_bytes)})")
    good = [number for number, (_, problems) in verdicts.items() if not problems]
    if len(good) < len(verdicts):
        print(f"restore would use step {max(good)}" if good else "no step here would restore")
    return 1 if len(good) < len(verdicts) else 0


def cmd_inspect(url: str, step: int | None) -> int:
    """The manifest of step N (or of the newest committed step) once its files verify."""
    asked = step if step is not None else parse_step(url)
    if asked is None:
        selected = _select(url, None)
        if isinstance(selected, str):
            return _one_line(selected)
        asked = selected[-1].step
    info, problem = _verified_step(url, asked)
    if problem:
        return _one_line(problem)
    print(json.dumps(info.manifest, indent=2, sort_keys=True))
    return 0


def cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="megatrain checkpoints", description="List, verify or inspect checkpoints.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="step, committed?, size and files of every checkpoint").add_argument("url")
    for name, text in (("verify", "re-hash every file against its manifest; exit 1 on corruption"),
                       ("inspect", "print the manifest of the newest committed checkpoint")):
        command = sub.add_parser(name, help=text)
        command.add_argument("url")
        command.add_argument("--step", type=int, default=None, help="only this step")
    args = parser.parse_args(argv)
    stages = stage_durable_urls(args.url)
    if stages and args.command == "inspect":
        stages = stages[-1:]  # the newest checkpoint of a campaign is its last stage's
    status = 0
    for url in stages or [args.url]:
        if stages:
            print(f"== {url}")
        try:
            if args.command == "list":
                status = max(status, cmd_list(url))
            elif args.command == "verify":
                status = max(status, cmd_verify(url, args.step))
            else:
                status = max(status, cmd_inspect(url, args.step))
        except OSError as exc:  # StorageError names the URL
            print(f"megatrain checkpoints: {exc}", file=sys.stderr)
            return 2
    return status


def main() -> int:
    return cli(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())


def stage_durable_urls(target: str | Path) -> list[str]:
    """Each stage's durable checkpoint URL when ``target`` is a campaign dir or its ``durable``
    dir (checkpoints sit in per-stage folders); [] when it is anything else (a run's own URL)."""
    path = Path(target)
    if not path.is_dir() or any(parse_step(child.name) is not None for child in path.iterdir()):
        return []
    try:
        campaign_dir = find_campaign_dir(path).resolve()
    except FileNotFoundError:
        campaign_dir = None
    if campaign_dir in (path.resolve(), path.resolve().parent):
        # each stage's store where it lies now (a moved campaign's recorded paths point elsewhere)
        return [str(read_run_dir(d).located()["checkpoint"]["durable_url"]) for d in stage_dirs(campaign_dir)]
    return sorted(str(child) for child in path.iterdir()
                  if child.is_dir() and any(parse_step(c.name) is not None for c in child.iterdir()))
