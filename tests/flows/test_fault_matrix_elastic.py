"""Fault-matrix rows of elastic training, through the real ``pretrain`` flow (real Prefect server,
torchrun ranks, gloo, the real data pipeline).

- ``config_mismatch``: a campaign rerun with a model-changing override finds the stage's committed
  checkpoint written by the other model. The restore is refused in the rank (CheckpointMismatch,
  a deterministic error): the stage ends at once, 0 restarts, and the differing field with its
  old and new value is the message of the flow run's and the train-stage task run's Prefect state.
"""

from __future__ import annotations

import asyncio

import pytest

from megatrain.campaign import load_campaign
from megatrain.checkpoint import catalog

STAGE = """\
- name: only
  steps: 4
  overrides: [{extra}]
"""


async def _task_runs(flow_run_id) -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    async with get_client() as client:
        return await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))


@pytest.mark.usefixtures("prefect_api")
def test_config_mismatch_ends_the_stage_at_once(campaign_file):
    from flows.pretrain import pretrain

    first = campaign_file("mismatch", STAGE.format(extra=""))
    assert pretrain(str(first), return_state=True).is_completed()
    durable = load_campaign(first).stage_durable_url(0)
    assert [info.step for info in catalog.committed(durable)] == [2, 4]

    # the same campaign (same stage, same durable URL) with two layers instead of one
    changed = campaign_file("mismatch", STAGE.format(extra="model.n_layer=2"))
    state = pretrain(str(changed), return_state=True)
    assert state.is_failed(), state
    assert "model.n_layer: 1 -> 2" in state.message and "CheckpointMismatch" in state.message, state.message

    runs = asyncio.run(_task_runs(state.state_details.flow_run_id))
    launches = [r for r in runs if r.name.startswith("launch-ranks")]
    stages = [r for r in runs if r.name.startswith("train-stage")]
    assert len(launches) == 1, [r.name for r in launches]  # one attempt: no restart used
    assert len(stages) == 1 and stages[0].state.is_failed()
    assert "model.n_layer: 1 -> 2" in stages[0].state.message, stages[0].state.message
    assert [info.step for info in catalog.committed(durable)] == [2, 4]  # the checkpoint is untouched
    print(f"\nconfig_mismatch: 1 attempt, 0 restarts; flow state: {state.message[:300]}")
