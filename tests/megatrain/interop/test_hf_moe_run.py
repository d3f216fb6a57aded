"""Export and import of a trained MoE checkpoint (moe-tiny-cpu without its shared expert:
Qwen2-MoE's class, a dense first layer), and the recipe as it is refused in one line. The commands'
own functions run in this process (the `megatrain` entry points are tested with the dense models in
test_hf_runs.py): the one subprocess is the training run."""

import pytest
import torch
import transformers
import yaml

from megatrain.interop.checkpoint import load_run
from megatrain.interop.hf import ExportRefused, export_checkpoint, import_cli
from tests.megatrain.conftest import ROOT
from tests.megatrain.interop.test_hf_runs import ONE_STEP

MOE_TINY = ROOT / "configs" / "moe-tiny-cpu.yaml"


@pytest.mark.slow
def test_a_trained_moe_checkpoint_exports_and_imports_back(run_training, tmp_path):
    run_training([*ONE_STEP, "model.moe.n_shared_experts=0"], name="moe", config=MOE_TINY)
    export_checkpoint(str(tmp_path / "moe"), tmp_path / "out")
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    assert type(exported).__name__ == "Qwen2MoeForCausalLM" and exported.config.mlp_only_layers == [0]
    run = load_run(str(tmp_path / "moe"))
    idx = torch.randint(0, 2048, (2, 128), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (exported(idx).logits - run.model.eval()(idx)).abs().max().item() < 1e-5

    recipe = tmp_path / "from-moe.yaml"  # and back: a recipe continuing it, its model the trained one's
    assert import_cli(["--hf", str(tmp_path / "out"), "--config", str(MOE_TINY), "--out", str(recipe)]) == 0
    moe = yaml.safe_load(recipe.read_text())["model"]["moe"]
    assert (moe["n_experts"], moe["top_k"], moe["expert_d_ff"], moe["dense_layers"]) == (8, 2, 96, 1)

    # the recipe as it is (a softmax router with a shared expert) has no exact class: one line naming it
    with pytest.raises(ExportRefused) as refused:
        export_checkpoint(str(tmp_path / "moe"), tmp_path / "refused", config=str(MOE_TINY))
    assert "model.moe.n_shared_experts=1" in str(refused.value) and "\n" not in str(refused.value)
    assert not (tmp_path / "refused").exists()
