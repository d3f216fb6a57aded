"""A stage's checkpoint keepers, held by the flow: started before its first attempt, stopped when
it ends, however it ends (completed, failed, Ctrl-C, cancelled).

With ``checkpoint.memory_interval`` each node has a keeper (megatrain/checkpoint/keeper.py) that
holds its ranks' newest RAM snapshots and outlives their restarts. Started here, it is this flow
process's child in a session of its own: the ranks' process-group kill never reaches it, and
``die_with_parent`` ends it if the flow itself is killed. A keeper a rank had to start again
(after its node's keeper was lost) is found by its folder and stopped at the stage's end too, so
no keeper outlives the stage that used it. A stage's keepers are its own: every stage has its
own staging dirs, and the next stage starts from the previous one's committed checkpoint.

Only the local launcher: on Kubernetes the nodes are pods, and their ranks start their keepers.
"""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

from megatrain.checkpoint.keeper_control import PeerSettings, keeper_dir, start_keeper, stop_keeper
from megatrain.config.campaign import CampaignConfig
from tasks._log import run_logger


def stage_staging_dirs(campaign: CampaignConfig, index: int, cfg) -> list[Path]:
    """Each node's staging dir, as its ranks will have it (megatrain/launch/nodes.py for nnodes > 1)."""
    if campaign.nnodes == 1:
        return [Path(cfg.checkpoint.staging_dir)]
    from megatrain.launch.nodes import node_dir

    return [node_dir(campaign.stage_dir(index) / "nodes", node) / "staging" for node in range(campaign.nnodes)]


@contextlib.contextmanager
def stage_keepers(campaign: CampaignConfig, index: int, cfg) -> Iterator[list[Path]]:
    """The keeper folders of the stage's nodes while the stage runs (none without RAM checkpoints)."""
    if not cfg.checkpoint.memory_interval or campaign.launcher != "local":
        yield []
        return
    from megatrain.launch.ranks import die_with_parent
    from megatrain.launch.run_token import ensure_run_token

    ensure_run_token()  # the ranks get the same one (launch tasks): the peers' replication is bound to it
    folders = [keeper_dir(staging) for staging in stage_staging_dirs(campaign, index, cfg)]
    log_path = Path(cfg.train.run_dir) / "logs" / "keeper.log"
    started = []
    for node, folder in enumerate(folders):
        peer = PeerSettings.of_run(cfg, node, len(folders)) if len(folders) > 1 else None
        started.append(start_keeper(folder, log_path, peer, preexec_fn=die_with_parent))
    run_logger().info("stage %s: checkpoint keepers started (pids %s, log %s)", campaign.stages[index].name,
                      [p.pid for p in started], log_path)
    try:
        yield folders
    finally:
        stop_stage_keepers(folders, started)


def stop_stage_keepers(folders: list[Path], started: list = ()) -> list[int]:
    """Shut down every keeper of ``folders`` (also those ranks started) and reap the flow's own;
    returns the pids stopped."""
    stopped = [pid for pid in (stop_keeper(folder) for folder in folders) if pid is not None]
    for proc in started:  # ours: reaped, never a zombie; one that never answered (still starting) is ended
        if proc.poll() is None:
            proc.terminate()  # the keeper's SIGTERM handler: a clean exit
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if stopped:
        run_logger().info("checkpoint keepers stopped (pids %s)", stopped)
    return stopped
