"""The cluster of hosts a ``launcher: hosts`` campaign runs on, held by the flow for the campaign.

With ``cluster: <name>`` the stages run on that running cluster (``megatrain cluster up --hosts N``),
checked first (its node hosts and its Redis) and left up afterwards: it is its operator's. Without
one the flow brings up ``nnodes`` node hosts with the head, redis and storage hosts
(``megatrain.launch.cluster_services.up``, owned by the flow's process) and takes it down when the
campaign ends, however it ends: completed, failed, stopped, or an exception. A flow process killed
with SIGKILL runs no ``finally``; its cluster names a dead owner, and ``megatrain cluster sweep``
(or the next test run's sweep) removes it.

Nothing else of the flow touches the hosts: the stage's launch (``tasks/elastic.py``) starts the
node launcher with the cluster's name, and from then on the flow hears from the ranks only through
what the launcher reports.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from megatrain.config.campaign import CampaignConfig
from tasks._log import run_logger


class ClusterUnavailable(RuntimeError):
    """The campaign's cluster cannot be used or made (no root, no such cluster, a host missing)."""


def check_cluster(campaign: CampaignConfig) -> None:
    """The named cluster exists and has what the campaign's stages use: node0..node<nnodes-1> and a
    Redis (the ranks meet there, beat there, and each attempt's fencing epoch comes from it)."""
    from megatrain.launch import hosts
    from megatrain.launch.nodes import cluster_endpoints, host_role

    try:
        cluster = hosts.Cluster.load(campaign.cluster)
    except FileNotFoundError as exc:
        raise ClusterUnavailable(f"campaign {campaign.id}: cluster: {exc}") from None
    missing = [host_role(n) for n in range(campaign.nnodes) if host_role(n) not in cluster.hosts]
    if missing:
        raise ClusterUnavailable(f"campaign {campaign.id}: cluster {cluster.name} has no host {', '.join(missing)} "
                                 f"for nnodes {campaign.nnodes} (its hosts: {', '.join(cluster.hosts)})")
    if "redis" not in cluster_endpoints(cluster):
        raise ClusterUnavailable(f"campaign {campaign.id}: cluster {cluster.name} runs no Redis (brought up with "
                                 "--no-services?); a campaign's ranks beat and are fenced there")


@contextlib.contextmanager
def campaign_cluster(campaign: CampaignConfig) -> Iterator[CampaignConfig]:
    """The campaign as its stages see it: with ``cluster`` set to the cluster they run on (the
    campaign itself for another launcher). Raises ``ClusterUnavailable`` before any stage runs."""
    if campaign.launcher != "hosts":
        yield campaign
        return
    logger = run_logger()
    if campaign.cluster:
        check_cluster(campaign)
        logger.info("campaign %s on cluster %s (kept up afterwards)", campaign.id, campaign.cluster)
        yield campaign
        return
    from megatrain.launch import cluster_services, hosts

    reason = hosts.available()
    if reason:
        raise ClusterUnavailable(f"campaign {campaign.id}: launcher hosts: {reason}")
    cluster, endpoints = cluster_services.up(campaign.nnodes, services=True, owner_pid=os.getpid())
    logger.info("campaign %s: cluster %s up on %s.0/24: %s; %s", campaign.id, cluster.name, cluster.subnet,
                ", ".join(f"{h.role} {h.address}" for h in cluster.hosts.values()),
                ", ".join(f"{k} {v}" for k, v in endpoints.items()))
    try:
        yield campaign.model_copy(update={"cluster": cluster.name})
    finally:
        removed = hosts.down(cluster.name)
        logger.info("campaign %s: cluster %s down (%d processes, %d namespaces, %d links removed)", campaign.id,
                    cluster.name, len(removed["pids"]), len(removed["netns"]), len(removed["links"]))
