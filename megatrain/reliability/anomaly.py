"""Training-anomaly detectors: NaN/inf loss, loss spikes, gradient-norm explosions, and (MoE) a
collapsing router or dead experts.

The trainer feeds every step's loss and gradient norm to an ``AnomalyDetector``. A ``Verdict``
means "stop": the trainer writes it with ``write_verdict`` and exits non-zero, and the
orchestrator reads it with ``read_verdict`` and rolls back to the last good checkpoint, skipping
the data window that caused it.

A spike is judged against a robust baseline - the median and the MAD (median absolute
deviation) of the recent losses - because a mean and standard deviation are dragged along by
the very outliers they should expose. Anomalous values never enter the window.

A router is judged by streaks, not single steps (``RouterHealth``): one expert serving more than
``router_collapse_share`` of a layer's tokens, or an expert with no token at all, for
``router_collapse_steps`` steps in a row. The shares are summed over the data-parallel ranks
(``megatrain/model/moe.py`` ``end_step``), so every rank reaches the same verdict. The checks start
after the router's warm-up (``router_warmup_steps``, by default the LR warm-up): a freshly
initialised router is skewed and leaves experts idle until the balancing takes hold.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from megatrain.config import AnomalyConfig
from megatrain.reliability._files import atomic_write_text

VERDICT_FILE = "verdict.json"
# MAD * 1.4826 estimates the standard deviation of normally distributed data.
MAD_TO_SIGMA = 1.4826
log = logging.getLogger(__name__)


@dataclass
class Verdict:
    """kind: nan_loss | inf_loss | loss_spike | nan_grad_norm | grad_explosion | fp8_amax | fp8_underflow |
    router_collapse | dead_expert (these two name the MoE ``layer`` and ``expert``; value = its share)."""

    kind: str
    step: int
    value: float
    baseline: float | None
    message: str
    zscore: float | None = None
    layer: int | None = None
    expert: int | None = None

    def to_json(self) -> str:
        # Strict JSON has no NaN/Infinity: write non-finite numbers as strings.
        data = {key: _encode(value) for key, value in asdict(self).items()}
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Verdict:
        data: dict[str, Any] = json.loads(text)
        for key in ("value", "baseline", "zscore"):
            if isinstance(data.get(key), str):
                data[key] = float(data[key])
        return cls(**data)


def _encode(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # "nan", "inf", "-inf": float() reads them back
    return value


class RobustWindow:
    """The last ``size`` accepted values, with a robust z-score of a new value against them."""

    def __init__(self, size: int) -> None:
        self.values: deque[float] = deque(maxlen=size)

    def __len__(self) -> int:
        return len(self.values)

    def add(self, value: float) -> None:
        self.values.append(value)

    def median(self) -> float:
        return statistics.median(self.values)

    def zscore(self, value: float) -> float:
        median = self.median()
        mad = statistics.median(abs(v - median) for v in self.values)
        # A flat window (MAD 0) would make any wiggle infinite; floor the scale at 0.1% of the level.
        scale = max(MAD_TO_SIGMA * mad, 1e-3 * abs(median), 1e-12)
        return (value - median) / scale


class AnomalyDetector:
    """``observe(step, loss, grad_norm)`` -> a ``Verdict`` when the step is anomalous, else None.

    Spikes are judged only after ``warmup_steps`` and once ``min_history`` losses are in the
    window: the loss falls fast early on and a short window has no stable spread.
    """

    def __init__(self, cfg: AnomalyConfig, moe_top_k: int | None = None, lr_warmup_steps: int = 0) -> None:
        """``moe_top_k``: the MoE model's top_k, which turns the router checks on (None: off);
        ``lr_warmup_steps``: the router checks' start when ``cfg.router_warmup_steps`` is None."""
        self.cfg = cfg
        self.losses = RobustWindow(cfg.loss_window)
        self.grad_norms = RobustWindow(cfg.loss_window)
        after = lr_warmup_steps if cfg.router_warmup_steps is None else cfg.router_warmup_steps
        self.routers = RouterHealth(cfg, moe_top_k, after) if moe_top_k else None

    def observe(self, step: int, loss: float, grad_norm: float | None = None,
                fp8: dict[str, float] | None = None, moe: dict | None = None) -> Verdict | None:
        """``fp8``: ``megatrain.precision.FP8Guard.stats()`` of this step, when measured; ``moe``: the
        step's expert-load health (``megatrain.model.moe.end_step``), with MoE layers."""
        loss = float(loss)
        verdict = self._check_loss(step, loss)
        if verdict is None and grad_norm is not None:
            verdict = self._check_grad_norm(step, float(grad_norm))
        if verdict is None and fp8:
            verdict = self._check_fp8(step, fp8)
        if verdict is None and moe and self.routers is not None:
            verdict = self.routers.observe(step, moe)
        if verdict is None:
            self.losses.add(loss)
            if grad_norm is not None:
                self.grad_norms.add(float(grad_norm))
        return verdict

    def state_dict(self) -> dict[str, Any]:
        """The loss and gradient-norm windows (JSON), for the checkpoint: an uninterrupted run
        would judge the step after the checkpoint against them. Any value refused ends the run in a
        verdict, so a window holds the last ``loss_window`` values whatever the thresholds."""
        return {"loss_window": self.cfg.loss_window, "losses": list(self.losses.values),
                "grad_norms": list(self.grad_norms.values)}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Put the windows of a checkpoint back. A window of another ``loss_window`` keeps its last
        values up to this run's size; a longer one than the checkpoint's (full) window is refilled
        from the values there are, and the log says so (none: a checkpoint written before windows
        were recorded starts them empty, also said)."""
        if not state:
            log.info("anomaly windows start empty: the checkpoint holds none (written before they were recorded)")
            return
        for window, values in ((self.losses, state.get("losses") or []), (self.grad_norms, state.get("grad_norms") or [])):
            window.values.clear()
            window.values.extend(float(v) for v in values)
        saved = int(state.get("loss_window") or self.cfg.loss_window)
        if self.cfg.loss_window > saved and len(state.get("losses") or []) >= saved:
            log.warning("anomaly windows: reliability.anomaly.loss_window %d -> %d; the checkpoint's %d values are "
                        "kept and the window fills up from here", saved, self.cfg.loss_window, saved)

    def _ready(self, step: int, window: RobustWindow) -> bool:
        return step >= self.cfg.warmup_steps and len(window) >= self.cfg.min_history

    def _check_loss(self, step: int, loss: float) -> Verdict | None:
        baseline = self.losses.median() if len(self.losses) else None
        if self.cfg.nan_check and not math.isfinite(loss):
            kind = "nan_loss" if math.isnan(loss) else "inf_loss"
            return Verdict(kind, step, loss, baseline, f"step {step}: loss is {loss}")
        if not self._ready(step, self.losses):
            return None
        z = self.losses.zscore(loss)
        if z > self.cfg.loss_spike_zscore:
            return Verdict(
                "loss_spike", step, loss, baseline,
                f"step {step}: loss {loss:.4g} is {z:.1f} robust sigmas above the median {baseline:.4g} "
                f"of the last {len(self.losses)} steps (threshold {self.cfg.loss_spike_zscore})",
                zscore=z,
            )
        return None

    def _check_fp8(self, step: int, fp8: dict[str, float]) -> Verdict | None:
        """An FP8 weight whose amax is inf/NaN, or too many weights flushed to zero by their cast."""
        if fp8["fp8_nonfinite"] > 0 or not math.isfinite(fp8["fp8_amax_max"]):
            return Verdict("fp8_amax", step, fp8["fp8_amax_max"], None,
                           f"step {step}: {int(fp8['fp8_nonfinite'])} FP8 linear(s) have a non-finite weight amax")
        if fp8["fp8_underflow"] > self.cfg.fp8_max_underflow:
            return Verdict("fp8_underflow", step, fp8["fp8_underflow"], None,
                           f"step {step}: {100 * fp8['fp8_underflow']:.2f}% of the FP8 weights flush to zero in "
                           f"their e4m3 cast (fp8_max_underflow {100 * self.cfg.fp8_max_underflow:.2f}%; weight "
                           f"amax up to {fp8['fp8_amax_max']:.4g})")
        return None

    def _check_grad_norm(self, step: int, norm: float) -> Verdict | None:
        baseline = self.grad_norms.median() if len(self.grad_norms) else None
        if self.cfg.nan_check and not math.isfinite(norm):
            return Verdict("nan_grad_norm", step, norm, baseline, f"step {step}: gradient norm is {norm}")
        if self.cfg.grad_norm_max is not None and norm > self.cfg.grad_norm_max:
            return Verdict(
                "grad_explosion", step, norm, baseline,
                f"step {step}: gradient norm {norm:.4g} exceeds grad_norm_max {self.cfg.grad_norm_max}",
            )
        if self.cfg.grad_norm_zscore is not None and self._ready(step, self.grad_norms):
            z = self.grad_norms.zscore(norm)
            if z > self.cfg.grad_norm_zscore:
                return Verdict(
                    "grad_explosion", step, norm, baseline,
                    f"step {step}: gradient norm {norm:.4g} is {z:.1f} robust sigmas above the median "
                    f"{baseline:.4g} (threshold {self.cfg.grad_norm_zscore})",
                    zscore=z,
                )
        return None


class RouterHealth:
    """Streaks per (layer, expert): steps in a row over the collapse share, and with no token.

    The share of tokens is the expert's share of the routed slots times top_k (each token fills
    k slots with k different experts), so 1.0 means every token went to this expert whatever k
    is. A streak restarts in a relaunched attempt: after a rollback the router must collapse for
    the full count again before the next verdict."""

    def __init__(self, cfg: AnomalyConfig, top_k: int, after_step: int = 0) -> None:
        self.cfg, self.top_k, self.after_step = cfg, top_k, after_step
        self.hot: dict[tuple[str, int], int] = {}
        self.dead: dict[tuple[str, int], int] = {}

    def observe(self, step: int, moe: dict) -> Verdict | None:
        if step <= self.after_step:  # the router's warm-up: skew and idle experts are expected
            return None
        cfg, need = self.cfg, self.cfg.router_collapse_steps
        found: Verdict | None = None
        for layer, health in sorted(moe.get("layers", {}).items(), key=lambda item: int(item[0])):
            shares = health["share"]
            balanced = self.top_k / len(shares)
            if cfg.router_collapse_share is not None and balanced < cfg.router_collapse_share:  # k = E: no choice
                for expert, share in enumerate(shares):
                    tokens = share * self.top_k
                    streak = self._count(self.hot, (layer, expert), tokens > cfg.router_collapse_share)
                    if streak >= need and found is None:
                        found = Verdict(
                            "router_collapse", step, tokens, balanced,
                            f"step {step}: MoE layer {layer}: expert {expert} took {100 * tokens:.1f}% of the tokens "
                            f"({100 * share:.1f}% of the routed slots) for {streak} steps in a row "
                            f"(router_collapse_share {cfg.router_collapse_share}; balanced {100 * balanced:.1f}%)",
                            layer=int(layer), expert=expert)
            if cfg.dead_experts:
                dead = [e for e, share in enumerate(shares) if self._count(self.dead, (layer, e), share <= 0) >= need]
                if dead and found is None:
                    found = Verdict(
                        "dead_expert", step, 0.0, balanced,
                        f"step {step}: MoE layer {layer}: expert{'s' if len(dead) > 1 else ''} "
                        f"{', '.join(map(str, dead))} routed no token for {need} steps in a row "
                        f"(balanced share of the tokens {100 * balanced:.1f}%)",
                        layer=int(layer), expert=dead[0])
        return found  # every streak is counted before the first verdict is returned

    @staticmethod
    def _count(streaks: dict[tuple[str, int], int], key: tuple[str, int], bad: bool) -> int:
        streaks[key] = streaks.get(key, 0) + 1 if bad else 0
        return streaks[key]


def verdict_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / VERDICT_FILE


def write_verdict(run_dir: str | Path, verdict: Verdict) -> Path:
    """Hand a verdict to the orchestrator: ``<run_dir>/verdict.json``, written atomically."""
    path = verdict_path(run_dir)
    atomic_write_text(path, verdict.to_json() + "\n")
    return path


def read_verdict(run_dir: str | Path) -> Verdict | None:
    """The verdict the trainer left, or None if it stopped for another reason (or finished)."""
    try:
        return Verdict.from_json(verdict_path(run_dir).read_text())
    except FileNotFoundError:
        return None


def clear_verdict(run_dir: str | Path) -> None:
    """Remove a handled verdict before relaunching, so it is not acted on twice."""
    verdict_path(run_dir).unlink(missing_ok=True)
