"""The expert-load heat map (megatrain/report/expert_load.py): each cell the mean share over the
stage's surviving timeline, drawn with a colour per load, and in the campaign report's pictures
for an MoE stage only."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from megatrain.config import load_config
from megatrain.launch.ranks import write_run_config
from megatrain.report.campaign import build_report
from megatrain.report.expert_load import plot_expert_load, stage_expert_load

ROOT = Path(__file__).resolve().parents[3]
BALANCED = [0.25] * 4
HOT = [0.7, 0.1, 0.2, 0.0]


def row(step: int, *layers: list[float] | None) -> str:
    found = {"step": step, "loss": 5.0, "lr": 1e-3, "grad_norm": 1.0, "tokens": 64 * step, "step_time_s": 0.1,
             "tokens_per_s": 640.0, "mfu": None, "phases_ms": {}}
    if layers:  # MoE layers 1, 3, 5 (layers 0, 2, 4 dense)
        found["moe"] = {"layers": {str(2 * i + 1): {"share": s, "entropy": 1.0, "max_over_mean": 4 * max(s)}
                                   for i, s in enumerate(layers)}, "aux_loss": 1.0, "z_loss": 0.0, "max_over_mean": 1.0}
    return json.dumps(found)


def write_rows(run_dir: Path, rows: list[str]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("\n".join(rows) + "\n")


def test_the_stage_share_is_the_mean_over_the_surviving_steps(tmp_path):
    # step 2 was logged by an attempt that was rolled back: its redo replaces it
    write_rows(tmp_path, [row(1, BALANCED, HOT), row(2, HOT, HOT), row(2, BALANCED, BALANCED), row(3, BALANCED, HOT)])
    load = stage_expert_load(tmp_path)
    assert list(load) == [1, 3]
    assert load[1] == pytest.approx(BALANCED)
    assert load[3] == pytest.approx([(0.7 * 2 + 0.25) / 3, (0.1 * 2 + 0.25) / 3, (0.2 * 2 + 0.25) / 3, 0.25 / 3])
    write_rows(tmp_path / "dense", [row(1), row(2)])
    assert stage_expert_load(tmp_path / "dense") == {}
    assert plot_expert_load(tmp_path / "dense", tmp_path / "dense.png") is None
    assert not (tmp_path / "dense.png").exists()


def test_the_heat_map_shows_the_hot_expert_hot_and_the_dead_one_cold(tmp_path):
    import matplotlib.image

    def first_column(png: Path):
        """The left 40% of the picture: expert 0's cells and the layer labels, not the colour bar."""
        pixels = matplotlib.image.imread(png)[..., :3]
        return pixels[:, : int(pixels.shape[1] * 0.4)]

    def hot_cold(pixels) -> tuple[int, int]:
        red = (pixels[..., 0] > 0.6) & (pixels[..., 2] < 0.35)  # coolwarm's hot end
        blue = (pixels[..., 2] > 0.6) & (pixels[..., 0] < 0.35)  # its cold end
        return int(red.sum()), int(blue.sum())

    dead_first = [0.0, 0.4, 0.3, 0.3]
    write_rows(tmp_path, [row(s, BALANCED, HOT, dead_first) for s in range(1, 5)])
    png = plot_expert_load(tmp_path, tmp_path / "load.png", title="stage s")
    height, width = matplotlib.image.imread(png).shape[:2]
    assert height > 200 and width > 300
    red, blue = hot_cold(first_column(png))  # layer 3's expert 0 at 2.8x balanced, layer 5's with none
    assert red > 500 and blue > 500, (red, blue)
    # balanced layers alone: expert 0 at neither end of the scale
    write_rows(tmp_path / "even", [row(s, BALANCED, BALANCED) for s in range(1, 5)])
    red, blue = hot_cold(first_column(plot_expert_load(tmp_path / "even", tmp_path / "even.png")))
    assert red < 50 and blue < 50, (red, blue)


def test_the_campaign_report_has_an_expert_load_picture_per_moe_stage(tmp_path):
    campaign = tmp_path / "camp-moe"
    for name, rows in (("dense", [row(s) for s in (1, 2)]), ("routed", [row(s, BALANCED, HOT) for s in (1, 2, 3)])):
        overrides = [f"train.run_dir={campaign / name}", f"checkpoint.durable_url={campaign / 'durable' / name}",
                     "train.steps=3"]
        write_run_config(load_config(ROOT / "configs/moe-tiny-cpu.yaml", overrides), campaign / name / "config.yaml")
        write_rows(campaign / name, rows)
    report = build_report(campaign, [{"stage": n, "run_dir": str(campaign / n), "durable_url": str(campaign / "durable" / n),
                                      "steps": 3} for n in ("dense", "routed")])
    assert [t for t in report.pictures if "expert load" in t] == ["routed: expert load"]
    png = report.pictures["routed: expert load"]
    assert png == campaign / "report" / "expert-load-routed.png" and png.stat().st_size > 5_000
    assert report.summary["pictures"]["routed: expert load"] == str(png)
    assert "![routed: expert load](expert-load-routed.png)" in report.markdown
    inline = re.findall(r"!\[routed: expert load\]\(data:image/png;base64,[A-Za-z0-9+/=]{1000,}\)", report.ui_markdown)
    assert len(inline) == 1
    assert np.isclose(stage_expert_load(campaign / "routed")[3][0], 0.7)
