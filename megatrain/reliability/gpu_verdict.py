"""The self-check's verdict on the card: each GPU measurement against its kind's expected figure.

The fixed floors of ``reliability.selfcheck`` (``min_gemm_tflops``, ...) catch a node that cannot
train at all; they cannot tell a throttled H100 from a healthy slower card. Here the GEMM, copy
and all-reduce figures of ``selfcheck.run_node_checks`` are compared with the card's expected
figures (``gpu_expected``): below ``gpu_min_fraction`` x expected, the metric's verdict is
``slow``. With ``strict`` that fails the check (the campaign stops before training; a cluster
evicts the node); otherwise it is a warning and training goes on. A card the table lacks gets
the verdict ``unknown card (no expected figures)``, a failure only with ``fail_unknown_gpu``.

Works on the checks by their attributes (``name``, ``value``, ``passed``, ``detail``,
``expected``, ``fraction``, ``verdict``), so ``selfcheck`` imports this and not the reverse.
"""

from __future__ import annotations

from megatrain.config import ConfigError, SelfCheckConfig
from megatrain.reliability.gpu_expected import GpuExpected, expected_for, known_cards

UNKNOWN = "unknown card (no expected figures)"
SLOW, OK = "slow", "ok"


def gpu_metric(check_name: str) -> str | None:
    """The table's metric a check measures: gemm, memory_copy, allreduce (``allreduce_x8``)."""
    if check_name in ("gemm", "memory_copy"):
        return check_name
    return "allreduce" if check_name.startswith("allreduce_x") else None


def card_to_judge(device: str, sc: SelfCheckConfig) -> tuple[str, GpuExpected | None] | None:
    """(the name judged, its expected figures or None when unknown); None when there is no card
    to judge (a CPU node with no ``expected_gpu``). A configured ``expected_gpu`` the table does
    not know is a config error, not an unknown card: it is a typo a person must fix."""
    if sc.expected_gpu:
        expected = expected_for(sc.expected_gpu)
        if expected is None:
            raise ConfigError(f"reliability.selfcheck.expected_gpu: {sc.expected_gpu!r} is no card of the "
                              f"table (one of: {', '.join(known_cards())})")
        return sc.expected_gpu, expected
    if device == "cpu":
        return None
    return device, expected_for(device)


def judge_checks(device: str, checks: list, sc: SelfCheckConfig) -> str:
    """Sets ``expected``, ``fraction`` (measured / expected) and ``verdict`` on the GPU checks, and
    fails them as the policy says; returns the card's table name ("" when nothing was judged)."""
    judged = card_to_judge(device, sc)
    if judged is None:
        return ""
    name, expected = judged
    for check in checks:
        metric = gpu_metric(check.name)
        if metric is None:
            continue
        if expected is None:
            check.verdict = UNKNOWN
            if sc.fail_unknown_gpu:
                check.passed = False
                check.detail = (f"GPU {name!r}: {UNKNOWN}; reliability.selfcheck.fail_unknown_gpu is set "
                                f"(set expected_gpu to a known card to judge it)")
            continue
        check.expected = expected.figure(metric)
        if check.value is None:  # the measurement failed: already a failed check, with its reason
            check.verdict = "not measured"
            continue
        check.fraction = check.value / check.expected
        check.verdict = OK if check.fraction >= sc.gpu_min_fraction else SLOW
        if check.verdict == SLOW and sc.strict:
            check.passed = False
            check.detail = slow_message(name, expected, check, sc.gpu_min_fraction)
    return "" if expected is None else expected.card


def slow_message(name: str, expected: GpuExpected, check, min_fraction: float) -> str:
    """One line naming the card, the metric, measured vs expected."""
    return (f"GPU {name!r} ({expected.card}) slow: {check.name} {check.value:.4g} {check.unit} < "
            f"{min_fraction:g} x expected {check.expected:.4g} {check.unit} ({check.fraction:.2f} of expected)")


def warnings_of(device: str, checks: list, sc: SelfCheckConfig) -> list[str]:
    """The warning lines of a judged node that did not fail on them: slow metrics outside strict
    mode, an unknown card outside fail_unknown_gpu."""
    lines = []
    judged = card_to_judge(device, sc)
    if judged is None:
        return lines
    name, expected = judged
    for check in checks:
        if check.verdict == SLOW and check.passed and expected is not None:
            lines.append(slow_message(name, expected, check, sc.gpu_min_fraction)
                         + "; training goes on (reliability.selfcheck.strict is off)")
    if expected is None and any(c.verdict == UNKNOWN and c.passed for c in checks):
        lines.append(f"GPU {name!r}: {UNKNOWN}: measured figures recorded, not judged")
    return lines
