"""train.precision / train.fp8 / the FP8 anomaly knobs: every option validates, bad values name
their field, and FP8 with tensor parallelism is refused with its reason."""

import pytest

from megatrain.config.compat import fingerprint, state_fields
from megatrain.config import ConfigError, load_config
from megatrain.precision.fp8 import float8_linear_config


def test_defaults_are_bf16_and_tensorwise():
    cfg = load_config(None)
    assert cfg.train.precision == "bf16"
    assert cfg.train.fp8.recipe == "tensorwise"
    assert not cfg.train.fp8.keep_first_block and not cfg.train.fp8.keep_last_block and not cfg.train.fp8.emulate


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
@pytest.mark.parametrize("pow2", [None, True, False])
def test_every_recipe_builds_its_torchao_config(recipe, pow2):
    from torchao.float8.config import ScalingGranularity, ScalingType

    overrides = ["train.precision=fp8", f"train.fp8.recipe={recipe}", "train.fp8.emulate=true"]
    if pow2 is not None:
        overrides.append(f"train.fp8.round_scales_to_power_of_2={str(pow2).lower()}")
    config = float8_linear_config(load_config(None, overrides).train.fp8)
    assert config.emulate
    granularity = config.cast_config_input.scaling_granularity
    assert granularity == (ScalingGranularity.TENSORWISE if recipe == "tensorwise" else ScalingGranularity.AXISWISE)
    # rowwise recipes round scales to powers of 2 unless told otherwise; tensorwise does not
    assert config.round_scales_to_power_of_2 == (pow2 if pow2 is not None else recipe != "tensorwise")
    high_precision_wgrad = config.cast_config_input_for_grad_weight.scaling_type is ScalingType.DISABLED
    assert high_precision_wgrad == (recipe == "rowwise_with_gw_hp")


@pytest.mark.parametrize("override, field", [
    ("train.precision=fp16", "train.precision"),
    ("train.fp8.recipe=delayed", "train.fp8.recipe"),
    ("train.fp8.keep_first_block=maybe", "train.fp8.keep_first_block"),
    ("train.fp8.scaling=delayed", "train.fp8.scaling"),  # unknown key
    ("reliability.anomaly.fp8_max_underflow=0", "reliability.anomaly.fp8_max_underflow"),
    ("reliability.anomaly.fp8_max_underflow=1.5", "reliability.anomaly.fp8_max_underflow"),
    ("reliability.anomaly.fp8_check_interval=0", "reliability.anomaly.fp8_check_interval"),
])
def test_bad_fp8_options_name_their_field(override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(None, [override])


def test_fp8_with_tensor_parallelism_is_refused_with_the_reason():
    with pytest.raises(ConfigError, match="train.precision=fp8 with parallel.tp > 1 is not supported yet: .*column/row-parallel"):
        load_config(None, ["train.precision=fp8", "parallel.tp=2"])
    assert load_config(None, ["train.precision=bf16", "parallel.tp=2"]).parallel.tp == 2


def test_precision_is_part_of_the_fingerprint_only_when_fp8():
    """A bf16 run keeps the fingerprint it had before FP8 existed (its checkpoints resume); an FP8
    run and each FP8 option are different math (a checkpoint resumes only into the same)."""
    bf16 = load_config(None, [])
    assert fingerprint(load_config(None, ["train.fp8.recipe=rowwise"])) == fingerprint(bf16)  # unused in bf16
    fp8 = load_config(None, ["train.precision=fp8"])
    assert fingerprint(fp8) != fingerprint(bf16)
    assert fingerprint(load_config(None, ["train.precision=fp8", "train.fp8.keep_first_block=true"])) != fingerprint(fp8)


def test_who_casts_changes_neither_the_fp8_fingerprint_nor_the_state():
    """train.fp8.casts is an implementation choice (the same e4m3 values): a default FP8 run keeps
    the fingerprint FP8 runs had before the knob existed, and a checkpoint resumes under any value."""
    fp8 = load_config(None, ["train.precision=fp8"])
    # recorded on the fp8 branch, before train.fp8.casts and parallel.init existed
    assert fingerprint(fp8) == "d086dbf9d687810b"
    fused = load_config(None, ["train.precision=fp8", "train.fp8.casts=fused"])
    assert fingerprint(fused) != fingerprint(fp8)  # set away from its default it counts, as model.kernels
    assert state_fields(fused) == state_fields(fp8)
    assert "train.fp8.recipe" in state_fields(fp8) and "train.fp8.casts" not in state_fields(fp8)
