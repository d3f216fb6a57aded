"""The whole model that export, eval and generate read from an expert-parallel step
(``megatrain/interop/checkpoint.py``: ``full_state_dict``), at an EP degree past two digits.

A step of 104 EP ranks is written for real, one expert per EP rank, as the trainer names its files
(checkpoint/experts.py, files.py): the replicated weights in model-pp00-tp00.safetensors, EP rank e's
slice of each expert tensor in model-pp00-tp00-epEE.safetensors, each file listed with its size and
sha256 under its writer's rank in the manifest. The model is moe-tiny-cpu cut down to d_model 16 and
104 routed experts of width 4 (layer 1), so 105 small files.

The slices must join in EP rank order: as strings, ep100 sorts before ep11 (and -ep02 after -ep100),
which put experts out of place. A step whose EP files have a gap, or lack the last EP rank's file,
is refused in one line naming the step folder instead of giving a model with missing experts."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from megatrain.checkpoint.files import model_file, write_safetensors
from megatrain.config import load_config
from megatrain.interop.checkpoint import IncompleteCheckpoint, full_state_dict
from megatrain.model import GPT

ROOT = Path(__file__).resolve().parents[3]
EP = 104  # one expert per EP rank: ranks 100-103 have three digits


def _is_expert(name: str) -> bool:
    return ".mlp.experts." in name


@pytest.fixture(scope="module")
def step(tmp_path_factory) -> tuple[Path, dict, dict[str, torch.Tensor], GPT]:
    """(step dir, its manifest, the model's tensors, a meta-device skeleton of the model)."""
    cfg = load_config(ROOT / "configs" / "moe-tiny-cpu.yaml",
                      ["model.d_model=16", "model.vocab_size=256", f"model.moe.n_experts={EP}", "model.moe.expert_d_ff=4"])
    torch.manual_seed(0)
    tensors = {name: t.detach().clone() for name, t in GPT(cfg.model).state_dict().items()}
    assert {t.shape[0] for name, t in tensors.items() if _is_expert(name)} == {EP}
    step_dir = tmp_path_factory.mktemp("ep104") / "step-00000002"
    step_dir.mkdir()
    files: dict[str, dict] = {}

    def write(rank: int, name: str, content: dict[str, torch.Tensor]) -> None:
        record = write_safetensors(step_dir / name, content)
        files.setdefault(f"rank-{rank:05d}", {})[name] = {"size": record.size, "sha256": record.sha256}

    write(0, model_file(0, 0), {n: t for n, t in tensors.items() if not _is_expert(n)})
    for e in range(EP):  # dp_rank e writes EP rank e's slice: its one expert
        write(e, model_file(0, 0, e), {n: t[e:e + 1].contiguous() for n, t in tensors.items() if _is_expert(n)})
    with torch.device("meta"):
        skeleton = GPT(cfg.model)
    return step_dir, {"step": 2, "files": files}, tensors, skeleton


def _without(manifest: dict, name: str) -> dict:
    return {**manifest, "files": {rank: {n: r for n, r in files.items() if n != name}
                                  for rank, files in manifest["files"].items()}}


def test_expert_slices_join_in_ep_rank_order_past_two_digits(step):
    step_dir, manifest, tensors, skeleton = step
    names = [model_file(0, 0, e) for e in range(EP)]
    assert sorted(names) != names  # as strings: ...-ep10, -ep100, -ep101, ..., -ep11: the order this must not use
    whole = full_state_dict(str(step_dir), manifest, skeleton)
    assert whole.keys() == tensors.keys()
    wrong = [name for name in tensors if not torch.equal(whole[name], tensors[name])]
    assert wrong == [], f"out of place: {wrong}"


@pytest.mark.parametrize("gone, why", [
    (5, (r"the expert-parallel model files of pp 0 tp 0 miss EP rank\(s\) \[5\] of 0\.\.103 "
        r"\(e\.g\. model-pp00-tp00-ep05\.safetensors\)")),
    (EP - 1, (r"the 103 expert-parallel model files of pp 0 tp 0 hold 103 of the 104 experts of "
             r"blocks\.1\.mlp\.experts\.\w+: an EP rank's file is missing")),
])
def test_a_step_missing_an_ep_file_is_refused_naming_the_folder(step, gone, why):
    step_dir, manifest, _, skeleton = step
    with pytest.raises(IncompleteCheckpoint) as raised:
        full_state_dict(str(step_dir), _without(manifest, model_file(0, 0, gone)), skeleton)
    message = str(raised.value)
    assert "\n" not in message and re.fullmatch(re.escape(str(step_dir)) + ": " + why, message), message
