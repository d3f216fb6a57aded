"""Screenshots of a campaign's flow run in the Prefect UI (headless Chromium), and the check that
the pictures are really there: the loss-curve artifact page must show the curve's own colour.

    python scripts/ui_pictures.py --api http://127.0.0.1:4200/api --flow-run ID --out docs/screenshots

    python scripts/ui_pictures.py --url http://127.0.0.1:4200/runs --out runs.png      # any one page

Writes flow-run.png, artifacts.png, loss-curve.png, report.png and failed-attempt.png (the first launch-ranks
task run that did not complete, when there is one), and exits 1 when the loss curve is not
visible or a page came out blank. tests/scripts/test_serve_lifecycle.py runs it against a real `make serve`.

Why not just `chromium --headless --screenshot URL`: the UI is a single-page app that draws
itself from API calls after the page has loaded, and headless Chromium takes its screenshot at
load, so the picture is one flat colour. ``--virtual-time-budget`` lets the page's scripts and
requests run first; ``--no-sandbox`` is needed as root, ``--disable-gpu`` on a machine without
one. The UI calls the API at the address the server was started with (``PREFECT_UI_API_URL``,
default http://127.0.0.1:4200/api): a server on another port needs that set, or every page shows
"Can't connect to Server API".
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from PIL import Image

TRAIN_COLOR = (0x1F, 0x77, 0xB4)  # the first stage's training loss (megatrain.report.runs.STAGE_COLORS[0])
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def screenshot(url: str, out: Path, size: tuple[int, int] = (1400, 1000), wait_ms: int = 15000) -> Path:
    """One page in headless Chromium (Debian's chromium, flags that work on these machines)."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        raise RuntimeError("chromium not found: make services (apt-get install -y chromium)")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run([browser, *FLAGS, f"--user-data-dir={profile}", f"--window-size={size[0]},{size[1]}",
                        f"--virtual-time-budget={wait_ms}", f"--screenshot={out}", url],
                       check=True, capture_output=True, timeout=120)
    return out


def is_blank(png: Path, share: float = 0.97) -> bool:
    """A page that has not drawn itself yet: one colour covers nearly all of the screenshot."""
    import numpy as np

    image = np.asarray(Image.open(png).convert("RGB")).reshape(-1, 3)
    _, counts = np.unique(image, axis=0, return_counts=True)
    return counts.max() >= share * len(image)


def page_shot(url: str, out: Path, size: tuple[int, int] = (1400, 1000), tries: int = 5) -> Path:
    """A screenshot of a page, taken again with more time while it is still blank (a loaded
    machine can take longer than the first budget to draw the page: the budget is the browser's
    virtual time, while the API that the page asks answers in real time, so a pause of real time
    comes between tries)."""
    for attempt in range(1, tries + 1):
        screenshot(url, out, size, wait_ms=15000 * min(attempt, 3))
        if not is_blank(out):
            break
        time.sleep(2.0 * attempt)
    return out


def pixels_near(png: Path, rgb: tuple[int, int, int], tolerance: int = 24) -> int:
    """How many pixels of the screenshot are within ``tolerance`` of a colour (per channel)."""
    import numpy as np

    image = np.asarray(Image.open(png).convert("RGB"), dtype=np.int16)  # (height, width, 3)
    return int((np.abs(image - np.array(rgb, dtype=np.int16)) <= tolerance).all(axis=-1).sum())


async def _find(api: str, flow_run_id: str) -> dict:
    """The artifacts and the first failed launch-ranks task run of a flow run, from the API."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, FlowRunFilter, FlowRunFilterId
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: api}):
        async with get_client() as client:
            artifacts = await client.read_artifacts(
                artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
            task_runs = await client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    loss = [a for a in artifacts if (a.key or "").endswith("loss-curve")]
    report = [a for a in artifacts if (a.key or "").endswith("-report")]
    attempts = sorted((t for t in task_runs if t.name.startswith("launch-ranks")), key=lambda t: t.expected_start_time)
    failed = [t for t in attempts if t.state and not t.state.is_completed()]
    return {"loss": loss[0] if loss else None, "report": report[0] if report else None, "failed": (failed or [None])[0], "attempts": attempts}


def picture_shot(url: str, out: Path, size: tuple[int, int], min_pixels: int = 400, tries: int = 3) -> Path:
    """A screenshot of a page that shows the loss curve, taken again (with more time) while the
    curve's colour is not there yet: on a loaded machine the page can still be loading."""
    for attempt in range(1, tries + 1):
        screenshot(url, out, size, wait_ms=15000 * attempt)
        if pixels_near(out, TRAIN_COLOR) >= min_pixels:
            break
    return out


def capture(api: str, flow_run_id: str, out: Path) -> dict[str, Path]:
    ui = api.removesuffix("/api")
    found = asyncio.run(_find(api, flow_run_id))
    if found["loss"] is None:
        raise RuntimeError(f"flow run {flow_run_id} has no loss-curve artifact")
    shots = {
        "flow-run": page_shot(f"{ui}/runs/flow-run/{flow_run_id}", out / "flow-run.png"),
        "artifacts": page_shot(f"{ui}/artifacts", out / "artifacts.png"),
        "loss-curve": picture_shot(f"{ui}/artifacts/artifact/{found['loss'].id}", out / "loss-curve.png", (1400, 1100)),
    }
    if found["report"] is not None:
        shots["report"] = picture_shot(f"{ui}/artifacts/artifact/{found['report'].id}", out / "report.png", (1400, 2000))
    if found["failed"] is not None:
        shots["failed-attempt"] = page_shot(f"{ui}/runs/task-run/{found['failed'].id}", out / "failed-attempt.png",
                                            (1400, 2000))  # tall enough for the attempt's last log lines
    return shots


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--api", help="the Prefect API URL, e.g. http://127.0.0.1:4200/api")
    parser.add_argument("--flow-run", help="the pretrain flow run's id")
    parser.add_argument("--url", help="screenshot this one page instead (written to --out, a .png path)")
    parser.add_argument("--out", default="docs/screenshots")
    parser.add_argument("--min-pixels", type=int, default=400, help="curve-coloured pixels that prove the picture shows")
    args = parser.parse_args(argv)
    if args.url:
        out = page_shot(args.url, Path(args.out) if args.out.endswith(".png") else Path(args.out) / "page.png")
        blank = is_blank(out)
        print(f"{out}{': blank (is the server up, and PREFECT_UI_API_URL its address?)' if blank else ''}")
        return 1 if blank else 0
    if not (args.api and args.flow_run):
        parser.error("give --api and --flow-run (a campaign's pictures), or --url (one page)")
    shots = capture(args.api, args.flow_run, Path(args.out))
    curve = pixels_near(shots["loss-curve"], TRAIN_COLOR)
    blank = [name for name, path in shots.items() if is_blank(path)]
    for name, path in shots.items():
        print(f"{name}: {path}{' (blank)' if name in blank else ''}")
    print(f"loss-curve pixels: {curve} (need {args.min_pixels})")
    return 0 if curve >= args.min_pixels and not blank else 1


if __name__ == "__main__":
    sys.exit(main())
