"""The verdict, table and plot of ``convergence.py``, and the merge of results from several
processes (one run per process, or runs split over machines' calls) into one comparison.

Verdict: the largest |megatrain - peer seed 0| held-out difference over the curve against the
seed-to-seed band, the largest |peer seed 0 - peer seed 1| over the same evaluation steps. The two
peers differ only in their initial weights (megatrain's init under seed 0 or 1, exported); the
data order is the same, so the band is the spread a different start alone gives.
"""

from __future__ import annotations

import json
from pathlib import Path


def _val_by_step(run: dict) -> dict[int, float]:
    return {point["step"]: point["loss"] for point in run["val"]}


def _max_gap(a: dict, b: dict) -> tuple[float | None, int | None]:
    steps = sorted(set(_val_by_step(a)) & set(_val_by_step(b)))
    if not steps:
        return None, None
    va, vb = _val_by_step(a), _val_by_step(b)
    worst = max(steps, key=lambda s: abs(va[s] - vb[s]))
    return abs(va[worst] - vb[worst]), worst


def verdict(runs: dict[str, dict], ours: str = "megatrain", peer: str = "peer:0", other: str = "peer:1") -> dict:
    """The parity numbers, from the evaluation steps the runs share."""
    out: dict = {"compared": [ours, peer, other]}
    if ours in runs and peer in runs:
        out["max_abs_diff_megatrain_peer0"], out["at_step_megatrain_peer0"] = _max_gap(runs[ours], runs[peer])
        n = min(len(runs[ours]["train_loss"]), len(runs[peer]["train_loss"]))
        rel = [abs(a - b) / abs(b) for a, b in zip(runs[ours]["train_loss"][:n], runs[peer]["train_loss"][:n])]
        out["train_rel_diff_first_20_steps_max"] = max(rel[:20]) if rel else None
    if peer in runs and other in runs:
        out["band_max_abs_diff_peer0_peer1"], out["at_step_band"] = _max_gap(runs[peer], runs[other])
    if ours in runs and peer in runs and other in runs:
        gap, band = out["max_abs_diff_megatrain_peer0"], out["band_max_abs_diff_peer0_peer1"]
        out["within_band"] = None if gap is None or band is None else gap <= band
        finals = {name: runs[name]["val"][-1]["loss"] for name in (ours, peer, other) if runs[name]["val"]}
        out["final_val_loss"] = finals
        if len(finals) == 3:
            out["final_gap"] = abs(finals[ours] - finals[peer])
            out["final_band"] = abs(finals[peer] - finals[other])
    return out


def table(report: dict) -> str:
    """One row per run: final train loss (mean of its last 50 steps) and held-out loss, step time."""
    lines = [f"| run | implementation | init seed | steps | tokens | train loss (last 50) | held-out loss | s/step |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    per_step = report["tokens_per_step"]
    for name, run in report["runs"].items():
        tail = run["train_loss"][-50:]
        val = f"{run['val'][-1]['loss']:.4f} (step {run['val'][-1]['step']})" if run["val"] else "-"
        lines.append(f"| {name} | {run['impl']} | {run['init_seed']} | {len(run['train_loss'])} | "
                     f"{len(run['train_loss']) * per_step / 1e6:.1f}M | {sum(tail) / max(1, len(tail)):.4f} | "
                     f"{val} | {run['step_s_mean']:.3f} |")
    v = report.get("verdict", {})
    if v.get("band_max_abs_diff_peer0_peer1") is not None and v.get("max_abs_diff_megatrain_peer0") is not None:
        lines.append("")
        lines.append(f"max |megatrain - peer:0| held-out: {v['max_abs_diff_megatrain_peer0']:.4f} (step "
                     f"{v['at_step_megatrain_peer0']}); seed band max |peer:0 - peer:1|: "
                     f"{v['band_max_abs_diff_peer0_peer1']:.4f} (step {v['at_step_band']}); "
                     f"within band: {v['within_band']}")
    return "\n".join(lines)


def _running_mean(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def plot(report: dict, path: Path, window: int = 25) -> None:
    """Top: train loss (running mean) and held-out loss against tokens, every run. Bottom: the
    held-out differences megatrain - peer:0 and peer:0 - peer:1 (the seed band)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True, height_ratios=[3, 1.4])
    colors = {"megatrain": "tab:blue", "peer:0": "tab:red", "peer:1": "tab:green"}
    per_step = report["tokens_per_step"]
    for name, run in report["runs"].items():
        color = colors.get(name, "tab:gray")
        losses = run["train_loss"]
        top.plot([(i + 1) * per_step / 1e6 for i in range(len(losses))], _running_mean(losses, window), color=color,
                 alpha=0.35, linewidth=0.8)
        top.plot([p["tokens"] / 1e6 for p in run["val"]], [p["loss"] for p in run["val"]], color=color, marker=".",
                 label=f"{name} ({run['impl']}, init seed {run['init_seed']}) held-out")
    top.set_ylabel("loss (nats/token)")
    starts = [run["val"][0]["loss"] for run in report["runs"].values() if run["val"]]
    if starts:  # the first steps' fall would flatten the rest
        top.set_ylim(top=min(top.get_ylim()[1], max(starts) + 0.2))
    top.set_title(report.get("title", ""), fontsize=8)
    top.legend(fontsize=7)
    top.grid(alpha=0.3)
    runs = report["runs"]
    for a, b, color in (("megatrain", "peer:0", "tab:blue"), ("peer:0", "peer:1", "tab:green")):
        if a in runs and b in runs:
            va, vb = _val_by_step(runs[a]), _val_by_step(runs[b])
            steps = sorted(set(va) & set(vb))
            bottom.plot([s * per_step / 1e6 for s in steps], [va[s] - vb[s] for s in steps], color=color,
                        marker=".", label=f"{a} - {b}")
    bottom.axhline(0, color="black", linewidth=0.5)
    bottom.set_ylabel("held-out difference")
    bottom.set_xlabel("training tokens (M); faint lines: train loss, running mean of %d steps" % window)
    bottom.legend(fontsize=7)
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def merge(paths: list[str]) -> dict:
    """One report from several: the runs of each, checked to have read the same corpus and the
    same batches (shard version, tokenizer hash, every step's batch digest)."""
    reports = [json.loads(Path(p).read_text()) for p in paths]
    base = dict(reports[0])
    base["runs"] = {}
    base["parts"] = []
    for path, report in zip(paths, reports):
        for key in ("tokenizer_sha256", "shard_version"):
            if report["data"][key] != reports[0]["data"][key]:
                raise SystemExit(f"{path}: {key} {report['data'][key]} differs from {paths[0]}'s")
        n = min(len(report["batch_crc32"]), len(reports[0]["batch_crc32"]))
        if report["batch_crc32"][:n] != reports[0]["batch_crc32"][:n]:
            first = next(i for i in range(n) if report["batch_crc32"][i] != reports[0]["batch_crc32"][i])
            raise SystemExit(f"{path}: the batch of step {first} differs from {paths[0]}'s")
        base["runs"].update(report["runs"])
        base["parts"].append({"file": Path(path).name, "runs": list(report["runs"]), "device": report["device"],
                              "commit": report.get("commit"), "wall_s": report.get("wall_s")})
    base["batch_crc32"] = max((r["batch_crc32"] for r in reports), key=len)
    base["verdict"] = verdict(base["runs"])
    return base
