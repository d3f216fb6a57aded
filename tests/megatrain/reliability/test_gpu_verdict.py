"""The self-check's verdict on a card: device names as CUDA reports them matched to their kind,
measured figures judged against the kind's expected ones (slow, ok, unknown card), and strict
mode failing the check. The GPU test measures the card it runs on."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatrain.config import ConfigError, SelfCheckConfig, load_config
from megatrain.reliability.gpu_expected import expected_for, known_cards
from megatrain.reliability.gpu_verdict import UNKNOWN, judge_checks, warnings_of
from megatrain.reliability.selfcheck import (
    CheckResult,
    NodeReport,
    SelfCheckReport,
    run_node_checks,
)


@pytest.mark.parametrize("device_name, card", [
    ("NVIDIA H100 80GB HBM3", "H100 SXM"),
    ("NVIDIA H100 PCIe", "H100 PCIe"),
    ("NVIDIA H100 NVL", "H100 NVL"),
    ("NVIDIA H200", "H200 SXM"),
    ("NVIDIA H200 NVL", "H200 NVL"),
    ("NVIDIA GH200 480GB", "GH200"),
    ("NVIDIA GH200 144G HBM3e", "GH200 HBM3e"),
    ("NVIDIA A100-SXM4-40GB", "A100 SXM 40GB"),
    ("NVIDIA A100-SXM4-80GB", "A100 SXM 80GB"),
    ("NVIDIA A100-PCIE-40GB", "A100 PCIe 40GB"),
    ("NVIDIA A100 80GB PCIe", "A100 PCIe 80GB"),
    ("NVIDIA L40S", "L40S"),
    ("NVIDIA L4", "L4"),
    ("NVIDIA A10G", "A10G"),
    ("NVIDIA GeForce RTX 4090", "RTX 4090"),
    ("NVIDIA B200", "B200"),
    # other cards whose names contain a known one: never judged by the wrong figures
    ("NVIDIA L40", None), ("NVIDIA A10", None), ("NVIDIA GB200", None), ("NVIDIA H800", None),
    ("NVIDIA GeForce RTX 4090 D", None), ("NVIDIA GeForce RTX 4090 Laptop GPU", None),
    ("NVIDIA H100 80GB HBM3 MIG 1g.10gb", None),  # a slice of the card does a slice of its work
])
def test_device_names_match_their_card(device_name: str, card: str | None) -> None:
    expected = expected_for(device_name)
    assert (expected and expected.card) == card


def test_every_card_of_the_table_is_found_by_its_own_name() -> None:
    """``expected_gpu`` may name a card as the table does; and no two rows share a name."""
    cards = known_cards()
    assert len(set(cards)) == len(cards)
    assert all(expected_for(card).card == card for card in cards)


def _h100_checks(gemm: float | None, copy: float, allreduce: float) -> list[CheckResult]:
    return [CheckResult("gemm", gemm, 0.005, "TFLOP/s", gemm is not None),
            CheckResult("memory_copy", copy, 0.2, "GB/s", True),
            CheckResult("allreduce_x8", allreduce, 0.01, "GB/s", True),
            CheckResult("storage", 900.0, 0.5, "MB/s", True)]


def test_a_slow_card_is_flagged_a_warning_unless_strict() -> None:
    h100 = expected_for("NVIDIA H100 80GB HBM3")
    slow_gemm = 0.6 * h100.gemm_tflops  # a throttled card: 60% of a healthy H100's GEMM
    checks = _h100_checks(slow_gemm, 0.95 * h100.memory_gbs, 1.1 * h100.allreduce_busbw_gbs)
    sc = SelfCheckConfig()
    assert judge_checks("NVIDIA H100 80GB HBM3", checks, sc) == "H100 SXM"
    gemm, copy, allreduce, storage = checks
    assert (gemm.verdict, copy.verdict, allreduce.verdict, storage.verdict) == ("slow", "ok", "ok", "")
    assert gemm.expected == h100.gemm_tflops and gemm.fraction == pytest.approx(0.6)
    assert allreduce.expected == h100.allreduce_busbw_gbs and storage.expected is None
    assert all(c.passed for c in checks)  # not strict: training goes on, with one warning line
    (warning,) = warnings_of("NVIDIA H100 80GB HBM3", checks, sc)
    assert warning.startswith(f"GPU 'NVIDIA H100 80GB HBM3' (H100 SXM) slow: gemm {slow_gemm:.4g} TFLOP/s < 0.8 x "
                              f"expected {h100.gemm_tflops} TFLOP/s (0.60 of expected)")

    strict = SelfCheckConfig(strict=True)
    checks = _h100_checks(slow_gemm, 0.95 * h100.memory_gbs, 0.5 * h100.allreduce_busbw_gbs)
    judge_checks("NVIDIA H100 80GB HBM3", checks, strict)
    assert [c.name for c in checks if not c.passed] == ["gemm", "allreduce_x8"]
    assert "allreduce_x8 169 GB/s < 0.8 x expected 338 GB/s (0.50 of expected)" in checks[2].detail
    assert warnings_of("NVIDIA H100 80GB HBM3", checks, strict) == []  # failed, not warned
    report = SelfCheckReport([NodeReport("node-a", "NVIDIA H100 80GB HBM3", checks, card="H100 SXM")])
    assert report.failing_nodes() == ["node-a"]  # on a cluster: the eviction list
    again = SelfCheckReport.from_json(report.to_json())
    assert again.nodes[0].checks[0].verdict == "slow" and again.nodes[0].card == "H100 SXM"
    assert "742 (0.60x)" in report.table() and "judged as H100 SXM" in report.table()

    # the fraction is the knob: at 0.5 a card at 60% passes
    lenient = _h100_checks(slow_gemm, h100.memory_gbs, h100.allreduce_busbw_gbs)
    judge_checks("NVIDIA H100 80GB HBM3", lenient, SelfCheckConfig(strict=True, gpu_min_fraction=0.5))
    assert all(c.passed for c in lenient) and [c.verdict for c in lenient[:3]] == ["ok"] * 3


def test_a_failed_measurement_is_not_judged_again() -> None:
    checks = _h100_checks(None, 3000.0, 340.0)
    judge_checks("NVIDIA H100 80GB HBM3", checks, SelfCheckConfig(strict=True))
    assert checks[0].verdict == "not measured" and checks[0].fraction is None and checks[0].detail == ""


def test_an_unknown_card_is_recorded_not_failed_unless_configured() -> None:
    checks = _h100_checks(100.0, 500.0, 20.0)
    assert judge_checks("NVIDIA RTX PRO 6000 Blackwell", checks, SelfCheckConfig(strict=True)) == ""
    assert [c.verdict for c in checks] == [UNKNOWN, UNKNOWN, UNKNOWN, ""]
    assert all(c.passed and c.expected is None and c.value is not None for c in checks)
    assert warnings_of("NVIDIA RTX PRO 6000 Blackwell", checks, SelfCheckConfig()) == [
        f"GPU 'NVIDIA RTX PRO 6000 Blackwell': {UNKNOWN}: measured figures recorded, not judged"]

    checks = _h100_checks(100.0, 500.0, 20.0)
    judge_checks("NVIDIA RTX PRO 6000 Blackwell", checks, SelfCheckConfig(fail_unknown_gpu=True))
    assert [c.name for c in checks if not c.passed] == ["gemm", "memory_copy", "allreduce_x8"]
    assert "fail_unknown_gpu" in checks[0].detail

    # the same card judged as a kind the table knows, by configuration
    checks = _h100_checks(100.0, 500.0, 20.0)
    assert judge_checks("NVIDIA RTX PRO 6000 Blackwell", checks, SelfCheckConfig(expected_gpu="L40S")) == "L40S"
    assert [c.verdict for c in checks[:3]] == ["slow", "slow", "ok"]


def test_a_cpu_node_is_not_judged_and_a_mistyped_card_is_a_config_error(tmp_path: Path) -> None:
    base = ["reliability.selfcheck.nproc_per_node=1", "reliability.selfcheck.gemm_size=128",
            "reliability.selfcheck.copy_mb=4", "reliability.selfcheck.storage_mb=1",
            f"checkpoint.durable_url={tmp_path}"]
    report = run_node_checks(load_config(overrides=base), node="cpu-node")
    assert report.device == "cpu" and report.card == "" and report.warnings == []
    assert all(c.verdict == "" and c.expected is None for c in report.checks) and report.passed
    with pytest.raises(ConfigError, match=r"reliability.selfcheck.expected_gpu: 'H10O SXM' is no card of the table"):
        run_node_checks(load_config(overrides=[*base, "reliability.selfcheck.expected_gpu=H10O SXM"]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_card_here_is_measured_and_judged(tmp_path: Path) -> None:
    """On a GPU machine: the real measurements (all-reduce over every visible GPU) judged against
    this card's row of the table; prints the table for the issue's closing note."""
    report = run_node_checks(load_config(overrides=[f"checkpoint.durable_url={tmp_path}"]), node="gpu-node")
    print("\n" + SelfCheckReport([report]).table())
    assert report.card in known_cards(), f"{report.device!r} is not in the table"
    gpu_checks = [c for c in report.checks if c.name in ("gemm", "memory_copy") or c.name.startswith("allreduce_x")]
    assert len(gpu_checks) == (3 if torch.cuda.device_count() > 1 else 2)
    for check in gpu_checks:
        assert check.value is not None, check.detail
        assert check.expected and check.fraction == pytest.approx(check.value / check.expected)
        assert check.verdict in ("ok", "slow")
    for check in gpu_checks[:2]:  # a table off by 2x for this card would show here
        assert 0.5 < check.fraction < 1.5, (check.name, check.value, check.expected)
