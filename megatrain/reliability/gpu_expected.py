"""What a healthy card of each kind should measure in the self-check, by device name.

Each figure is the vendor's peak times the fraction a healthy card really reaches in the
self-check's own measurement (``selfcheck.py``), so that ``gpu_verdict`` can call a card slow
when it falls well below its kind rather than below a fixed floor:

- ``gemm_tflops``: dense bf16 ``torch.mm`` of 8192^3 (fp32 accumulate). Peak = the datasheet's
  dense figure (half the "with sparsity" one). Hopper/Blackwell SXM parts reach ~0.75-0.8 of it;
  power-capped PCIe parts (350-400 W for an H100 PCIe/NVL, 72 W for an L4) clock lower, ~0.5-0.65.
- ``memory_gbs``: a device-to-device copy, bytes read + written. Peak = the datasheet's memory
  bandwidth; a copy reaches ~0.85-0.9 of it on HBM, ~0.8 on GDDR.
- ``allreduce_busbw_gbs``: NCCL all-reduce bus bandwidth among the node's GPUs (NVLink multicast
  off). Peak = one direction of the GPU's link (NVLink's "bidirectional" figure halved; PCIe
  x16 one way). Over NVLink NCCL reaches ~0.75; over PCIe it depends on the host (switches,
  peer-to-peer allowed, NUMA), so those figures are conservative (0.6 with peer-to-peer, 0.35
  through host memory where peer-to-peer is usually off), and a card on an NVLink bridge
  (H100/H200 NVL, A100 PCIe) beats its PCIe figure rather than being judged by the bridge.

Measured on the GPU machines this project runs on (2026-10/11, torch 2.11, cu130): H100 SXM 769-798
TFLOP/s and ~3.0 TB/s copy; H200 788 TFLOP/s and ~4.3 TB/s copy; 2-8 H100 SXM all-reduce of
1 GiB 329-361 GB/s bus bandwidth. The self-check itself (2026-11-26): 2 H200s GEMM 680-706 TFLOP/s
(0.92-0.95 of 742), copy 4120-4152 GB/s (1.01-1.02), all-reduce of 1 GiB 328-329 GB/s (0.97 of
338); one H100 SXM GEMM 688-697 (0.93-0.94), copy 2949-2955 (1.04). Those agree with the fractions below; the other cards' figures are datasheet x
fraction, not yet measured by this project. Pure Python: no torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class GpuExpected:
    card: str  # the table's name for the kind, e.g. "H100 SXM"
    gemm_tflops: float
    memory_gbs: float
    allreduce_busbw_gbs: float
    link: str  # what the all-reduce figure assumes

    def figure(self, metric: str) -> float:
        return {"gemm": self.gemm_tflops, "memory_copy": self.memory_gbs, "allreduce": self.allreduce_busbw_gbs}[metric]


# Achievable fractions of the peak (see the module docstring for why each).
SXM_GEMM, PCIE_GEMM = 0.75, 0.65
HBM_COPY, GDDR_COPY = 0.85, 0.8
NVLINK_AR, PCIE_P2P_AR, PCIE_HOST_AR = 0.75, 0.6, 0.35
PCIE4, PCIE5 = 32.0, 64.0  # GB/s one direction of an x16 link
NVLINK3, NVLINK4, NVLINK5 = 300.0, 450.0, 900.0  # GB/s one direction per GPU (600/900/1800 bidirectional)


def _card(card: str, tflops: float, gemm_frac: float, mem_gbs: float, copy_frac: float,
          link_gbs: float, link_frac: float, link: str) -> GpuExpected:
    return GpuExpected(card, round(tflops * gemm_frac), round(mem_gbs * copy_frac), round(link_gbs * link_frac), link)


# (pattern on the normalised device name, expected figures); the first match wins, so the more
# specific names (NVL, PCIe, GH200) come before the bare ones. Patterns use word boundaries:
# "GH200" must not read as H200, "L40S" not as L4, "A100" not as A10G, "GB200" not as B200.
TABLE: list[tuple[str, GpuExpected]] = [
    # Grace Hopper: H100 datasheet compute (989 dense bf16); GH200 datasheet 4.0 TB/s HBM3 (96 GB)
    # or 4.9 TB/s HBM3e (144 GB); GPUs of several superchips talk over NVLink 4 (900 GB/s).
    (r"\bGH200\b.*\b(144G|HBM3E)", _card("GH200 HBM3e", 989, SXM_GEMM, 4900, HBM_COPY, NVLINK4, NVLINK_AR, "NVLink 4")),
    (r"\bGH200\b", _card("GH200", 989, SXM_GEMM, 4000, HBM_COPY, NVLINK4, NVLINK_AR, "NVLink 4")),
    # H200 datasheet: SXM 989 dense bf16 (1,979 sparse), 4.8 TB/s HBM3e, NVLink 900 GB/s;
    # NVL (PCIe, 600 W) 835 dense (1,671 sparse), 4.8 TB/s, 2/4-way NVLink bridge or PCIe Gen5.
    (r"\bH200\b.*\bNVL\b", _card("H200 NVL", 835, PCIE_GEMM, 4800, HBM_COPY, PCIE5, PCIE_P2P_AR, "PCIe Gen5")),
    (r"\bH200\b", _card("H200 SXM", 989, SXM_GEMM, 4800, HBM_COPY, NVLINK4, NVLINK_AR, "NVLink 4")),
    # H100 datasheet: SXM 989 dense (1,979 sparse), 3.35 TB/s HBM3, NVLink 900 GB/s; PCIe (350 W)
    # 756 dense (1,513 sparse), 2.0 TB/s HBM2e; NVL (400 W) 835 dense (1,671 sparse), 3.9 TB/s,
    # NVLink bridge 600 GB/s between pairs, else PCIe Gen5. "NVIDIA H100 80GB HBM3" is the SXM.
    (r"\bH100\b.*\bNVL\b", _card("H100 NVL", 835, PCIE_GEMM, 3900, HBM_COPY, PCIE5, PCIE_P2P_AR, "PCIe Gen5")),
    (r"\bH100\b.*\bPCIE\b", _card("H100 PCIe", 756, PCIE_GEMM, 2000, HBM_COPY, PCIE5, PCIE_P2P_AR, "PCIe Gen5")),
    (r"\bH100\b", _card("H100 SXM", 989, SXM_GEMM, 3350, HBM_COPY, NVLINK4, NVLINK_AR, "NVLink 4")),
    # A100 datasheet: 312 dense bf16 (624 sparse); 40 GB 1,555 GB/s; 80 GB SXM 2,039, PCIe 1,935;
    # SXM NVLink 3 600 GB/s, PCIe Gen4 (a bridge between pairs beats that). Ampere reaches ~0.8 of
    # its peak on SXM, ~0.75 on the 250-300 W PCIe card.
    (r"\bA100\b.*\bPCIE\b.*\b80GB\b|\bA100\b.*\b80GB\b.*\bPCIE\b",
     _card("A100 PCIe 80GB", 312, 0.75, 1935, HBM_COPY, PCIE4, PCIE_P2P_AR, "PCIe Gen4")),
    (r"\bA100\b.*\bPCIE\b", _card("A100 PCIe 40GB", 312, 0.75, 1555, HBM_COPY, PCIE4, PCIE_P2P_AR, "PCIe Gen4")),
    (r"\bA100\b.*\b80GB\b", _card("A100 SXM 80GB", 312, 0.8, 2039, HBM_COPY, NVLINK3, NVLINK_AR, "NVLink 3")),
    (r"\bA100\b", _card("A100 SXM 40GB", 312, 0.8, 1555, HBM_COPY, NVLINK3, NVLINK_AR, "NVLink 3")),
    # B200 (HGX B200 datasheet): 36 PFLOPS bf16 sparse for 8 GPUs = 2.25 dense each, 8 TB/s HBM3e,
    # NVLink 5 1.8 TB/s. Datasheet x Hopper-like fractions; not measured here.
    (r"\bB200\b", _card("B200", 2250, 0.7, 8000, 0.8, NVLINK5, NVLINK_AR, "NVLink 5")),
    # L40S datasheet: 362 dense bf16 (733 sparse), 864 GB/s GDDR6, PCIe Gen4, 350 W (~0.6 of peak).
    (r"\bL40S\b", _card("L40S", 362, 0.6, 864, GDDR_COPY, PCIE4, PCIE_P2P_AR, "PCIe Gen4")),
    # L4 datasheet: 121 dense bf16 (242 sparse), 300 GB/s GDDR6, PCIe Gen4, 72 W: power-capped (~0.5).
    (r"\bL4\b", _card("L4", 121, 0.5, 300, GDDR_COPY, PCIE4, PCIE_P2P_AR, "PCIe Gen4")),
    # A10G (AWS's A10 variant, no NVIDIA datasheet): ~70 dense bf16 as AWS/third parties list it
    # (the A10's datasheet says 125), 600 GB/s GDDR6, PCIe Gen4, cloud VMs without peer-to-peer.
    (r"\bA10G\b", _card("A10G", 70, 0.8, 600, GDDR_COPY, PCIE4, PCIE_HOST_AR, "PCIe Gen4, no P2P")),
    # RTX 4090 (Ada whitepaper): 165 dense bf16 with fp32 accumulate (330 with fp16 accumulate,
    # which torch.mm does not use), 1,008 GB/s GDDR6X, PCIe Gen4 without peer-to-peer. The
    # "4090 D" (fewer SMs) and the laptop part (another chip) are other cards.
    (r"\bRTX 4090\b(?! D\b)(?!.*\bLAPTOP\b)", _card("RTX 4090", 165, 0.85, 1008, 0.85, PCIE4, PCIE_HOST_AR, "PCIe Gen4, no P2P")),
]


def normalise(device_name: str) -> str:
    return " ".join(re.sub(r"[-_/]", " ", device_name).upper().split())


def expected_for(device_name: str) -> GpuExpected | None:
    """The expected figures of the card CUDA names ``device_name`` (``torch.cuda.get_device_name``),
    or None for a card the table lacks. A MIG slice gets only part of the card: None too."""
    name = normalise(device_name)
    if re.search(r"\bMIG\b", name):
        return None
    for pattern, expected in TABLE:
        if re.search(pattern, name):
            return expected
    return None


def known_cards() -> list[str]:
    return [expected.card for _, expected in TABLE]
