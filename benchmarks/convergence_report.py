"""The verdict, table and plot of ``convergence.py``, and the merge of results from several
processes (one run per process, or runs split over machines' calls) into one comparison.

Verdict: the largest |megatrain - peer seed 0| held-out difference over the curve against the
seed-to-seed band, the largest |peer seed 0 - peer seed 1| over the same evaluation steps, both
after step 0 (where the same-start pair is identical by construction and the band is only the two
inits' spread). The two peers differ only in their initial weights (megatrain's init under seed 0
or 1, exported); the data order is the same, so the band is the spread a different start alone
gives. Means over the curve and the final gap are given beside the maxima.

With more than two peer seeds (``--runs megatrain,peer:0,peer:1,peer:2,peer:3``) two draws of a
maximum no longer stand for the band: ``band_all_seeds`` is the widest |peer:i - peer:j| over every
pair of seeds, and the same-start gap is taken over every seed k run on both sides (megatrain:k
against peer:k; seed 0 is ``megatrain``).
"""

from __future__ import annotations

import json
import re
from itertools import combinations
from pathlib import Path


def _val_by_step(run: dict) -> dict[int, float]:
    return {point["step"]: point["loss"] for point in run["val"]}


def gaps(a: dict, b: dict) -> dict | None:
    """|a - b| held-out over the evaluation steps both have after step 0: max (and its step), mean, final."""
    va, vb = _val_by_step(a), _val_by_step(b)
    steps = sorted(s for s in set(va) & set(vb) if s > 0)
    if not steps:
        return None
    diff = {s: abs(va[s] - vb[s]) for s in steps}
    worst = max(steps, key=diff.__getitem__)
    return {"max": diff[worst], "at_step": worst, "mean": sum(diff.values()) / len(diff), "final": diff[steps[-1]],
            "final_step": steps[-1]}


PAIRS = {"megatrain_vs_peer0": ("megatrain", "peer:0"), "band_peer0_vs_peer1": ("peer:0", "peer:1"),
         "megatrain1_vs_peer1": ("megatrain:1", "peer:1 (rerun)"), "peer1_rerun": ("peer:1", "peer:1 (rerun)"),
         "megatrain_reference_vs_megatrain": ("megatrain@reference", "megatrain")}


def verdict(runs: dict[str, dict]) -> dict:
    """The parity numbers, from the evaluation steps the runs share."""
    out: dict = {"pairs": {key: {"runs": list(pair), **gaps(runs[pair[0]], runs[pair[1]])}
                           for key, pair in PAIRS.items()
                           if pair[0] in runs and pair[1] in runs and gaps(runs[pair[0]], runs[pair[1]])}}
    if "megatrain" in runs and "peer:0" in runs:
        a, b = runs["megatrain"]["train_loss"], runs["peer:0"]["train_loss"]
        rel = [abs(x - y) / abs(y) for x, y in zip(a[:20], b[:20])]
        out["train_rel_diff_first_20_steps_max"] = max(rel) if rel else None
    pair, band = out["pairs"].get("megatrain_vs_peer0"), out["pairs"].get("band_peer0_vs_peer1")
    if pair and band:
        out["max_abs_diff_megatrain_peer0"], out["at_step_megatrain_peer0"] = pair["max"], pair["at_step"]
        out["band_max_abs_diff_peer0_peer1"], out["at_step_band"] = band["max"], band["at_step"]
        out["within_band"] = pair["max"] <= band["max"]
        out["mean_within_band"] = pair["mean"] <= band["mean"]
    seeds = band_over_seeds(runs)
    if seeds:
        out["band_all_seeds"] = seeds
        out["within_band_all_seeds"] = seeds["same_start_max"] <= seeds["max"]
    out["final_val_loss"] = {name: run["val"][-1]["loss"] for name, run in runs.items() if run["val"]}
    return out


def band_over_seeds(runs: dict[str, dict]) -> dict | None:
    """With three or more peer seeds: the widest pair of them (the band) and the widest same-start
    pair (megatrain:k - peer:k over the seeds k run on both sides); None with fewer seeds."""
    peers = sorted((int(m.group(1)), name) for name in runs if (m := re.fullmatch(r"peer:(\d+)", name)))
    if len(peers) < 3:
        return None
    band = {f"{a}-{b}": gaps(runs[a], runs[b]) for (_, a), (_, b) in combinations(peers, 2)}
    band = {key: value for key, value in band.items() if value}
    same = {}
    for seed, peer in peers:
        ours = "megatrain" if seed == 0 else f"megatrain:{seed}"
        if ours in runs and (gap := gaps(runs[ours], runs[peer])):
            same[f"{ours}-{peer}"] = gap
    if not band or not same:
        return None
    widest, closest = max(band, key=lambda k: band[k]["max"]), max(same, key=lambda k: same[k]["max"])
    return {"seeds": [seed for seed, _ in peers], "max": band[widest]["max"], "pair": widest,
            "at_step": band[widest]["at_step"], "pairs": {k: v["max"] for k, v in band.items()},
            "same_start_max": same[closest]["max"], "same_start_pair": closest,
            "same_start": {k: v["max"] for k, v in same.items()}}


def _first_crossing(val: list[dict], target: float) -> float | None:
    """The step at which a held-out curve first reaches ``target``, interpolated linearly between
    the two evaluations around it; None when it never does."""
    for before, after in zip(val, val[1:]):
        if after["loss"] <= target:
            if before["loss"] <= target:
                return float(before["step"])
            share = (before["loss"] - target) / (before["loss"] - after["loss"])
            return before["step"] + share * (after["step"] - before["step"])
    return None


def time_to_target(report: dict, target_run: str, at_step: int | None = None) -> dict:
    """Wall time of every run to the held-out loss ``target_run`` reaches after N tokens (its
    evaluation at ``at_step``; default its last): the step it first reaches it times its mean step
    time (the steps' own time, evaluations excluded), and each run's tokens/s; ratios against
    ``target_run``. The speed figure a user steers by: a faster step that learns less per token
    reaches the target later. A target before the end leaves the runs room to reach it: at the
    end of a decayed schedule a run 0.001 behind never does."""
    runs, per_step = report["runs"], report["tokens_per_step"]
    if target_run not in runs or not runs[target_run]["val"]:
        raise SystemExit(f"--target-run {target_run!r}: no such run with a held-out curve ({', '.join(runs)})")
    val = runs[target_run]["val"]
    if at_step is None:
        last = val[-1]
    else:
        last = next((v for v in val if v["step"] == at_step), None)
        if last is None:
            raise SystemExit(f"--target-step {at_step}: {target_run} has no evaluation there "
                             f"(its steps: {', '.join(str(v['step']) for v in val)})")
    out = {"target_run": target_run, "target_loss": last["loss"], "target_tokens": last["tokens"], "runs": {}}
    for name, run in runs.items():
        step = _first_crossing(run["val"], last["loss"])
        row = {"tokens_per_s": per_step / run["step_s_mean"], "step_s": run["step_s_mean"],
               "first_steps_s": run.get("first_steps_s"),  # compile / autotune, once per run: not in wall_s
               "reached_at_step": step, "tokens": None if step is None else step * per_step,
               "wall_s": None if step is None else step * run["step_s_mean"]}
        out["runs"][name] = row
    base = out["runs"][target_run]
    for row in out["runs"].values():
        row["speedup_tokens_per_s"] = row["tokens_per_s"] / base["tokens_per_s"]
        row["speedup_time_to_target"] = None if row["wall_s"] is None else base["wall_s"] / row["wall_s"]
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
    pairs = report.get("verdict", {}).get("pairs", {})
    if pairs:
        lines += ["", "| held-out |a - b| after step 0 | max (step) | mean | final |", "| --- | --- | --- | --- |"]
        for pair in pairs.values():
            lines.append(f"| {pair['runs'][0]} - {pair['runs'][1]} | {pair['max']:.4f} ({pair['at_step']}) | "
                         f"{pair['mean']:.4f} | {pair['final']:.4f} |")
        if "within_band" in report["verdict"]:
            lines.append(f"\nwithin the seed band (max): {report['verdict']['within_band']}; "
                         f"(mean): {report['verdict']['mean_within_band']}")
        seeds = report["verdict"].get("band_all_seeds")
        if seeds:
            lines.append(f"\nband over peer seeds {seeds['seeds']}: widest {seeds['pair']} {seeds['max']:.4f} "
                         f"(step {seeds['at_step']}); widest same-start {seeds['same_start_pair']} "
                         f"{seeds['same_start_max']:.4f}: within {report['verdict']['within_band_all_seeds']}")
    target = report.get("time_to_target")
    if target:
        lines += ["", f"time to {target['target_run']}'s held-out loss {target['target_loss']:.4f} "
                      f"({target['target_tokens'] / 1e6:.1f}M tokens):", "",
                  "| run | tokens/s | x tokens/s | tokens to target | wall s to target | x time to target |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for name, row in target["runs"].items():
            reached = row["wall_s"] is not None
            lines.append(f"| {name} | {row['tokens_per_s']:,.0f} | {row['speedup_tokens_per_s']:.2f} | "
                         f"{row['tokens'] / 1e6:.2f}M | {row['wall_s']:.1f} | {row['speedup_time_to_target']:.2f} |"
                         if reached else f"| {name} | {row['tokens_per_s']:,.0f} | {row['speedup_tokens_per_s']:.2f} | "
                         "not reached | - | - |")
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
    colors = {"megatrain": "tab:blue", "peer:0": "tab:red", "peer:1": "tab:green", "megatrain:1": "tab:purple",
              "peer:1 (rerun)": "tab:olive", "megatrain@reference": "tab:gray"}
    per_step = report["tokens_per_step"]
    for name, run in report["runs"].items():
        color = colors.get(name, "tab:gray")
        losses = run["train_loss"]
        top.plot([(i + 1) * per_step / 1e6 for i in range(len(losses))], _running_mean(losses, window), color=color,
                 alpha=0.35, linewidth=0.8)
        top.plot([p["tokens"] / 1e6 for p in run["val"]], [p["loss"] for p in run["val"]], color=color, marker=".",
                 label=f"{name} ({run['impl']}, init seed {run['init_seed']}) held-out")
    top.set_ylabel("loss (nats/token)")
    seconds = [run["val"][1]["loss"] for run in report["runs"].values() if len(run["val"]) > 1]
    if seconds:  # the first steps' fall (from ln V) would flatten the rest
        top.set_ylim(top=min(top.get_ylim()[1], max(seconds) + 0.5))
    top.set_title(report.get("title", ""), fontsize=8)
    top.legend(fontsize=7)
    top.grid(alpha=0.3)
    runs = report["runs"]
    styles = {"megatrain_vs_peer0": ("tab:blue", "-"), "band_peer0_vs_peer1": ("tab:green", "-"),
              "megatrain1_vs_peer1": ("tab:purple", "--"), "peer1_rerun": ("tab:orange", ":"),
              "megatrain_reference_vs_megatrain": ("tab:gray", ":")}
    for key, (a, b) in PAIRS.items():
        if a in runs and b in runs:
            va, vb = _val_by_step(runs[a]), _val_by_step(runs[b])
            steps = sorted(set(va) & set(vb))
            color, line = styles[key]
            bottom.plot([s * per_step / 1e6 for s in steps], [va[s] - vb[s] for s in steps], color=color,
                        linestyle=line, marker=".", label=f"{a} - {b}")
    bottom.axhline(0, color="black", linewidth=0.5)
    bottom.set_ylabel("held-out difference")
    bottom.set_xlabel("training tokens (M); faint lines: train loss, running mean of %d steps" % window)
    bottom.legend(fontsize=7)
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def json_path(out: str) -> Path:
    """``--out`` as the JSON's path: ``<out>.json`` (``with_suffix`` would take ``.3b`` of
    ``convergence-gpt-1.3b`` for a suffix and write ``convergence-gpt-1.json``)."""
    return Path(out if out.endswith(".json") else out + ".json")


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
        for name, run in report["runs"].items():  # the same run again, from another process: kept beside it
            base["runs"][f"{name} (rerun)" if name in base["runs"] else name] = run
        base["parts"].append({"file": Path(path).name, "runs": list(report["runs"]), "device": report["device"],
                              "commit": report.get("commit"), "wall_s": report.get("wall_s")})
    base["batch_crc32"] = max((r["batch_crc32"] for r in reports), key=len)
    base["verdict"] = verdict(base["runs"])
    return base
