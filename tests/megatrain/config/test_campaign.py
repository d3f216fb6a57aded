from pathlib import Path

import pytest

from megatrain.config.campaign import load_campaign, stage_config
from megatrain.config import ConfigError

ROOT = Path(__file__).resolve().parents[3]


def write(tmp_path, text):
    path = tmp_path / "campaign.yaml"
    path.write_text(text)
    return path


BASE = """
id: t
recipe: configs/tiny-cpu.yaml
root_dir: {root}
nproc_per_node: 2
overrides: [train.global_batch_size=16]
stages:
  - {{name: one, steps: 5, overrides: [train.seq_len=64]}}
  - {{name: two, steps: 7}}
"""


def test_stages_resolve_into_full_run_configs(tmp_path):
    campaign = load_campaign(write(tmp_path, BASE.format(root=tmp_path)))
    one, two = stage_config(campaign, 0), stage_config(campaign, 1)
    assert (one.train.steps, one.seq_len, two.seq_len) == (5, 64, 128)
    assert one.train.run_dir == str(tmp_path / "t" / "one")
    assert two.checkpoint.init_from == one.checkpoint.durable_url != two.checkpoint.durable_url
    assert one.checkpoint.init_from is None
    assert one.parallel.world_size == 2
    assert campaign.fingerprint() == load_campaign(write(tmp_path, BASE.format(root=tmp_path))).fingerprint()


def test_bad_stage_override_names_the_stage_and_the_field(tmp_path):
    text = BASE.format(root=tmp_path).replace("train.seq_len=64", "train.seq_len=4096")
    with pytest.raises(ConfigError) as info:
        load_campaign(write(tmp_path, text))
    message = str(info.value)
    assert "campaign.yaml" in message and "stage 'one'" in message and "train.seq_len (4096) must be <= model.seq_len" in message


def test_batch_that_does_not_split_over_the_ranks_is_refused(tmp_path):
    text = BASE.format(root=tmp_path).replace("train.global_batch_size=16", "train.global_batch_size=8")
    with pytest.raises(ConfigError, match="micro_batch_size \\* dp"):
        load_campaign(write(tmp_path, text))


@pytest.mark.parametrize("bad, reason", [
    ("stages: []", "at least 1 item"),
    ("stages: [{name: a, steps: 1}, {name: a, steps: 2}]", "stage names must be unique"),
    ("stages: [{name: 'a b', steps: 1}]", "String should match pattern"),
    ("stages: [{name: a, steps: 0}]", "greater than 0"),
    # a name is a folder: '..' would put the stage's files beside the campaign's, '.' into it
    ("stages: [{name: '..', steps: 1}]", "stages.0.name: String should match pattern"),
    ("stages: [{name: '.', steps: 1}]", "stages.0.name: String should match pattern"),
    ("stages: [{name: .hidden, steps: 1}]", "stages.0.name: String should match pattern"),
])
def test_campaign_errors(tmp_path, bad, reason):
    text = f"id: t\nrecipe: configs/tiny-cpu.yaml\nroot_dir: {tmp_path}\n{bad}\n"
    with pytest.raises(ConfigError, match=reason):
        load_campaign(write(tmp_path, text))


@pytest.mark.parametrize("campaign_id", ["..", ".", "../x", ".x"])
def test_a_campaign_id_never_leaves_the_root_dir(tmp_path, campaign_id):
    with pytest.raises(ConfigError, match="id: String should match pattern"):
        load_campaign(write(tmp_path, BASE.format(root=tmp_path)), [f"id={campaign_id}"])


def test_overrides_reach_the_campaign(tmp_path):
    campaign = load_campaign(write(tmp_path, BASE.format(root=tmp_path)), ["id=other"])
    assert campaign.id == "other" and campaign.campaign_dir == tmp_path / "other"


# Where a value came from (issue 48): a campaign file's own overrides, a stage's and the command line
# are each named as themselves.

ORIGINS = """
id: t
recipe: {recipe}
root_dir: {root}
shard_url: {root}/shards
overrides: [{campaign}]
stages:
  - {{name: warm, steps: 5, overrides: [{stage}]}}
"""


def _refusal(tmp_path, campaign="train.seq_len=64", stage="train.seq_len=64", recipe="configs/tiny-cpu.yaml",
             command_line=None) -> str:
    path = write(tmp_path, ORIGINS.format(root=tmp_path, recipe=recipe, campaign=campaign, stage=stage))
    with pytest.raises(ConfigError) as info:
        load_campaign(path, command_line)
    return str(info.value)


def test_a_misspelled_key_in_the_campaign_files_overrides_is_blamed_on_them_not_the_command_line(tmp_path):
    message = _refusal(tmp_path, campaign="optim.lrr=3e-4")
    assert message.startswith(f"{tmp_path / 'campaign.yaml'}: stage 'warm': invalid config"), message
    assert "optim.lrr: Extra inputs are not permitted (did you mean 'lr'?) (set by the override 'optim.lrr=3e-4' " \
           "in the campaign's overrides)" in message
    assert "command line" not in message


def test_a_stage_override_of_a_field_that_does_not_exist_names_the_stage(tmp_path):
    message = _refusal(tmp_path, stage="model.n_layr=2")
    assert "(set by the override 'model.n_layr=2' in the overrides of stage 'warm')" in message, message
    assert "command line" not in message and "campaign's overrides" not in message


def test_a_value_of_the_wrong_type_in_the_campaign_file_is_blamed_on_the_file(tmp_path):
    message = _refusal(tmp_path, campaign="optim.lr=fast")
    assert "optim.lr: Input should be a valid number" in message
    assert "(set by the override 'optim.lr=fast' in the campaign's overrides)" in message and "command line" not in message


def test_duplicate_mixture_names_are_blamed_on_the_mixture_not_on_the_campaigns_shard_url(tmp_path):
    mixture = "'data.mixture=[{name: a, sources: [x.txt], weight: 1}, {name: a, sources: [y.txt], weight: 1}]'"
    message = _refusal(tmp_path, stage=mixture)
    assert "component names must be unique, ['a'] repeat" in message
    assert "in the overrides of stage 'warm')" in message and "shard_url" not in message, message
    recipe = tmp_path / "recipe.yaml"  # the mixture in the recipe: the recipe is named, not a derived value
    recipe.write_text("data:\n  mixture:\n    - {name: a, sources: [x.txt], weight: 1}\n"
                      "    - {name: a, sources: [y.txt], weight: 1}\n")
    message = _refusal(tmp_path, recipe=str(recipe))
    assert f"stage 'warm': {recipe}: invalid config" in message and "shard_url" not in message, message


def test_the_command_line_is_named_for_what_it_set(tmp_path):
    message = _refusal(tmp_path, command_line=["optim.lr=1"])
    assert message.startswith("the command line: invalid config") and "(set by the override 'optim.lr=1')" in message


def test_a_cluster_campaign_never_uses_the_unauthenticated_tcp_store(tmp_path):
    cluster = ROOT / "configs/campaign-cluster.yaml"
    with pytest.raises(ConfigError, match=r"stage 'main': parallel.init.store=tcp: on launcher kubernetes .*Redis"):
        load_campaign(cluster, ["overrides=[parallel.init.store=tcp, reliability.redis_url=redis://r:6379/0]"])
    with pytest.raises(ConfigError, match=r"stage 'main': launcher kubernetes needs reliability.redis_url"):
        load_campaign(cluster, ["overrides=[]"])
