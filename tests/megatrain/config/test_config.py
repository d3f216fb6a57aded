from pathlib import Path

import pytest

from megatrain.config.campaign import CampaignConfig, load_campaign
from megatrain.config.compat import fingerprint
from megatrain.config import Config
from megatrain.config import ConfigError, load_config, parse_overrides

ROOT = Path(__file__).resolve().parents[3]
RECIPES = sorted((ROOT / "configs").glob("*.yaml"))


def test_there_are_recipes():
    names = {p.name for p in RECIPES}
    assert {"tiny-cpu.yaml", "gpt-125m.yaml", "gpt-1.3b.yaml", "gpt-175b.yaml", "llama-tiny-cpu.yaml", "llama-1b.yaml",
            "llama-8b.yaml", "campaign-llama-local.yaml", "campaign-long-context.yaml",
            "campaign-long-context-gpu.yaml"} <= names


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_every_recipe_loads(path):
    if path.name.startswith("campaign-"):  # a campaign validates each stage as a full run config
        # nproc_per_node: auto counts this machine's GPUs (none here: test_campaign_gpu.py tests that refusal)
        gpus = ["nproc_per_node=1"] if "nproc_per_node: auto" in path.read_text() else None
        assert isinstance(load_campaign(path, gpus), CampaignConfig)
        return
    cfg = load_config(path)
    assert isinstance(cfg, Config)
    assert len(fingerprint(cfg)) == 16


def test_shapes_of_the_reference_recipes():
    m = load_config(ROOT / "configs/gpt-1.3b.yaml").model
    assert (m.n_layer, m.d_model, m.n_head, m.seq_len, m.vocab_size) == (24, 2048, 16, 2048, 50304)
    big = load_config(ROOT / "configs/gpt-175b.yaml")
    assert (big.model.n_layer, big.model.d_model, big.model.n_head, big.model.seq_len, big.model.vocab_size) == (
        96, 12288, 128, 2048, 64000)
    assert (big.parallel.tp, big.parallel.pp) == (8, 8)


def test_shapes_of_the_llama_recipes():
    small = load_config(ROOT / "configs/llama-1b.yaml").model
    assert (small.n_layer, small.d_model, small.n_head, small.kv_heads, small.ffn_dim, small.vocab_size) == (
        16, 2048, 32, 8, 8192, 128256)
    assert (small.position, small.rope_theta, small.norm, small.mlp, small.bias, small.tie_embeddings) == (
        "rope", 500000.0, "rmsnorm", "swiglu", False, True)
    assert small.rope_scaling is not None and small.rope_scaling.factor == 32.0
    big = load_config(ROOT / "configs/llama-8b.yaml")
    assert (big.model.n_layer, big.model.d_model, big.model.n_head, big.model.kv_heads, big.model.ffn_dim) == (
        32, 4096, 32, 8, 14336)
    assert not big.model.tie_embeddings and big.model.kv_heads % big.parallel.tp == 0
    tiny = load_config(ROOT / "configs/llama-tiny-cpu.yaml").model
    assert (tiny.position, tiny.norm, tiny.mlp, tiny.kv_heads < tiny.n_head, tiny.ffn_dim) == ("rope", "rmsnorm", "swiglu", True, 384)
    assert load_campaign(ROOT / "configs/campaign-llama-local.yaml").recipe.endswith("llama-tiny-cpu.yaml")


def test_gpt_recipes_keep_their_fingerprints():
    """Recorded before the Llama knobs existed: existing checkpoints and cached stages stay valid."""
    recorded = {"gpt-1.3b": "cb6c01959c8be93c", "gpt-125m": "d02f6c28821a6db5", "gpt-175b": "780d9e82d7ce709f",
                "tiny-cpu": "c532aadfd51abce9"}
    # gpt-1.3b moved from ZeRO-0 to ZeRO-1 (bf16 ZeRO-0 cannot be checkpointed): the one change, so
    # with its old zero_stage it still has its recorded fingerprint
    then = {"gpt-1.3b": ["parallel.zero_stage=0"]}
    assert {name: fingerprint(load_config(ROOT / f"configs/{name}.yaml", then.get(name, []))) for name in recorded} == recorded
    assert fingerprint(load_config(ROOT / "configs/tiny-cpu.yaml", ["model.norm=rmsnorm"])) != recorded["tiny-cpu"]


def test_overrides_are_parsed_and_applied(tmp_path):
    assert parse_overrides(["optim.lr=3e-4", "model.block=serial"]) == {"optim": {"lr": 3e-4}, "model": {"block": "serial"}}
    cfg = load_config(ROOT / "configs/tiny-cpu.yaml", ["optim.lr=3e-3", "train.steps=7"])
    assert cfg.optim.lr == 3e-3 and cfg.train.steps == 7


def _error(tmp_path, text, overrides=None):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    return str(info.value)


@pytest.mark.parametrize(
    "text, field, reason",
    [
        ("model: {n_layers: 2}", "model.n_layers", "Extra inputs are not permitted"),
        ("model: {n_layer: -1}", "model.n_layer", "greater than 0"),
        ("model: {block: diagonal}", "model.block", "'parallel' or 'serial'"),
        ("model: {d_model: 100, n_head: 12}", "model", "divisible by n_head"),
        ("model: {attention: sliding, window: 4096, seq_len: 1024}", "model", "window (4096) must be <= seq_len"),
        ("model: {attention: sliding}", "model", "window: required"),
        ("model: {n_head: 12}\nparallel: {tp: 8}", "(top level)", "parallel.tp (8) must divide model.n_head"),
        ("parallel: {tp: 2, pp: 2, dp: 2, world_size: 12}", "parallel", "!= world size 12"),
        ("parallel: {tp: 2, pp: 2, world_size: 6}", "parallel", "not divisible by tp*pp"),
        ("train: {micro_batch_size: 3, global_batch_size: 8}", "train", "multiple of micro_batch_size"),
        ("parallel: {dp: 4}\ntrain: {micro_batch_size: 2, global_batch_size: 4}", "(top level)", "micro_batch_size * dp"),
        ("optim: {lr: 1e-4, min_lr: 1e-3}", "optim", "min_lr"),
        ("optim: {name: sgd}", "optim.name", "'lamb' or 'adamw'"),
        ("model: {n_head: 12, n_kv_head: 5}", "model", "n_head (12) must be divisible by n_kv_head (5)"),
        ("model: {d_model: 36, n_head: 12, position: rope}", "model", "position rope needs an even head_dim"),
        ("model: {rope_scaling: {factor: 8}}", "model", "rope_scaling: only with position 'rope'"),
        ("model: {position: rope, rope_scaling: {low_freq_factor: 4, high_freq_factor: 1}}", "model.rope_scaling.llama3",
         "high_freq_factor (1.0) must exceed low_freq_factor"),
        ("model: {norm: batchnorm}", "model.norm", "'layernorm' or 'rmsnorm'"),
        ("model: {mlp: relu}", "model.mlp", "'gelu', 'swiglu' or 'moe'"),
        ("model: {n_head: 16, d_model: 1024, n_kv_head: 2}\nparallel: {tp: 4}", "(top level)",
         "parallel.tp (4) must divide model.n_kv_head (2): KV heads are sharded"),
    ],
)
def test_config_errors_name_file_field_and_reason(tmp_path, text, field, reason):
    message = _error(tmp_path, text)
    assert str(tmp_path / "bad.yaml") in message
    assert f"  {field}: " in message
    assert reason in message


def test_bad_yaml_and_missing_file_name_the_file(tmp_path):
    assert "not valid YAML" in _error(tmp_path, "model: [unclosed")
    assert "expected a mapping" in _error(tmp_path, "- a list")
    with pytest.raises(ConfigError, match="nope.yaml: config file not found"):
        load_config(tmp_path / "nope.yaml")


def test_bad_override_names_the_field(tmp_path):
    message = _error(tmp_path, "name: x", ["optim.lr=-1"])
    assert "optim.lr" in message
    with pytest.raises(ConfigError, match="expected key=value"):
        load_config(None, ["optim.lr"])


def test_data_parallel_size_is_derived_from_the_world():
    cfg = load_config(ROOT / "configs/gpt-175b.yaml")
    assert cfg.parallel.data_parallel_size(12288) == 192
    with pytest.raises(ValueError, match="not divisible by tp\\*pp"):
        cfg.parallel.data_parallel_size(100)


def test_an_unknown_key_gets_the_nearest_known_one_and_an_override_is_blamed_as_such(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("model:\n  n_layr: 2\n")
    with pytest.raises(ConfigError) as from_file:
        load_config(recipe)
    assert str(from_file.value) == f"{recipe}: invalid config\n  model.n_layr: Extra inputs are not permitted (did you mean 'n_layer'?)"
    with pytest.raises(ConfigError) as from_override:
        load_config(ROOT / "configs/tiny-cpu.yaml", ["optim.lrr=3e-4"])
    text = str(from_override.value)
    assert text.startswith("the command line: invalid config") and "(did you mean 'lr'?)" in text
    assert "(set by the override 'optim.lrr=3e-4')" in text and "tiny-cpu.yaml" not in text
    with pytest.raises(ConfigError, match=r"data.mixture.0.weigth: .*did you mean 'weight'"):
        load_config(None, ["data.mixture=[{name: a, sources: [x], weigth: 1}]"])
