"""Where a run's torch.compile caches go (megatrain/launch/compile_cache.py): the campaign's folder for
its stages, the run's own for a plain run, the environment's when set."""

from pathlib import Path

from megatrain.config.campaign import load_campaign, stage_config
from megatrain.launch.compile_cache import CACHE_DIR_ENV, cache_env, compile_cache_dir, count_files, use_compile_cache
from megatrain.launch.ranks import write_run_config


def test_stages_of_a_campaign_share_its_folder_and_a_plain_run_keeps_its_own(tmp_path, campaign_file, monkeypatch):
    monkeypatch.delenv(CACHE_DIR_ENV, raising=False)
    campaign = load_campaign(campaign_file("cache", "- {name: a, steps: 2}\n- {name: b, steps: 2}\n"))
    stage_dirs = []
    for index in range(2):  # as the flow writes them: <campaign dir>/<stage>/config.yaml
        cfg = stage_config(campaign, index)
        write_run_config(cfg, Path(cfg.train.run_dir) / "config.yaml")
        stage_dirs.append(cfg.train.run_dir)
    assert {compile_cache_dir(d) for d in stage_dirs} == {campaign.campaign_dir.resolve() / "compile-cache"}
    plain = tmp_path / "runs" / "tiny"
    assert compile_cache_dir(plain) == plain.resolve() / "compile-cache"
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "shared"))
    assert compile_cache_dir(plain) == compile_cache_dir(stage_dirs[0]) == (tmp_path / "shared").resolve()


def test_use_points_torch_and_triton_at_the_folder_and_counts_what_it_found(tmp_path, monkeypatch):
    monkeypatch.delenv(CACHE_DIR_ENV, raising=False)
    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "elsewhere"))  # a run's folder wins over an inherited one
    root = tmp_path / "run" / "compile-cache"
    assert use_compile_cache(tmp_path / "run") == {"dir": str(root.resolve()), "files_at_start": 0}
    import os

    assert {k: os.environ[k] for k in cache_env(root)} == cache_env(root.resolve())
    (root / "inductor" / "fxgraph").mkdir(parents=True)
    (root / "inductor" / "fxgraph" / "entry").write_text("x")
    assert count_files(root) == 1 and use_compile_cache(tmp_path / "run")["files_at_start"] == 1
