"""The shared expert beside the expert-parallel all-to-all (``parallel.overlap.ep_shared_expert``):
the rows' exchange is started, the shared expert runs, then the exchange is waited for; in the
backward the gradients' exchange is started before the shared expert's backward and waited for
after it. Checked on a one-rank gloo group with the collectives logged (the results of EP runs
against one process are in test_expert_parallel.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import megatrain.parallel.expert_parallel as expert_parallel
from megatrain.parallel.expert_parallel import ExpertExchange


class _Logged:
    """``torch.distributed`` as expert_parallel.py sees it, logging each all-to-all and wait."""

    def __init__(self, log: list[str]):
        self.log = log

    def __getattr__(self, name):
        return getattr(dist, name)

    def all_to_all_single(self, *args, async_op: bool = False, **kwargs):
        self.log.append("start" if async_op else "exchange")
        work = dist.all_to_all_single(*args, async_op=async_op, **kwargs)
        if not async_op:
            return work
        log = self.log

        class Logged:
            def wait(self):
                log.append("wait")
                return work.wait()

        return Logged()


class _Mark(torch.autograd.Function):
    """Identity that logs its forward and backward."""

    @staticmethod
    def forward(ctx, x, log, what):
        ctx.log, ctx.what = log, what
        log.append(f"{what} forward")
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.log.append(f"{ctx.what} backward")
        return grad, None, None


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield dist.new_group([0])
    dist.destroy_process_group()


@pytest.mark.parametrize("overlap", [True, False])
def test_the_shared_expert_runs_while_the_rows_travel(one_rank_group, monkeypatch, overlap):
    log: list[str] = []
    monkeypatch.setattr(expert_parallel, "dist", _Logged(log))
    exchange = ExpertExchange(one_rank_group, ep=1, n_experts=2, overlap=overlap)
    rows = torch.randn(6, 4, requires_grad=True)
    h = torch.randn(3, 4, requires_grad=True)
    counts = torch.tensor([4, 2])
    y, shared = exchange(rows, counts, lambda x, c: x * 2.0, lambda: _Mark.apply(h, log, "shared") * 3.0)
    forward = log[:]
    (y.sum() + shared.sum()).backward()
    backward = log[len(forward):]
    torch.testing.assert_close(rows.grad, torch.full_like(rows, 2.0))  # the same values either way
    torch.testing.assert_close(h.grad, torch.full_like(h, 3.0))
    if overlap:  # counts, rows started, shared, rows waited, outputs back
        assert forward == ["exchange", "start", "shared forward", "wait", "exchange"], forward
        assert backward == ["exchange", "start", "shared backward", "wait"], backward
    else:
        assert forward == ["exchange", "exchange", "shared forward", "exchange"], forward
        assert backward == ["exchange", "shared backward", "exchange"], backward  # each exchange waited for at once
