"""Communication/compute overlap, one switch each in ``parallel.overlap`` so each effect can be
measured by turning it off.

Tensor parallel (this module). With sequence parallelism every layer all-gathers its normalised
input before the column-parallel GEMMs and reduce-scatters the row-parallel output after them.
Done naively the GPU idles during both. Here the sequence shard is cut into ``tp_chunks`` pieces
and the collective of one piece runs while the GEMM of another computes (MegaScale section 3.3;
the "collective matmul" of Wang et al. 2023):

    all_gather_matmul      forward:  all-gather piece k+1   ||  GEMMs of piece k
                           backward: reduce-scatter dX of k ||  dX GEMMs of piece k+1, then dW
    matmul_reduce_scatter  forward:  reduce-scatter piece k ||  GEMM of piece k+1
                           backward: all-gather dY of k+1   ||  dX and dW GEMMs of piece k

Collectives are issued with ``async_op=True`` and waited on just before their result is read. On
GPU, NCCL runs an async collective on its own stream and ``work.wait()`` only makes the compute
stream wait, so the same code overlaps there (Megatron-LM sets CUDA_DEVICE_MAX_CONNECTIONS=1 so
the GPU starts kernels in issue order); on CPU with gloo the collective runs on gloo's thread.
``tp_chunks=1`` turns this off: the plain regions in tensor_parallel.py are used. Only sequence
parallelism uses it (without SP the regions are all-reduces, not chunked here).

Where it applies in megatrain's GPT (tensor_parallel.apply_tensor_parallel): the all-gather of
every block is fused with the attention ``qkv`` GEMM, which the enter region computes and hands
to the ``ColumnParallelLinear``; the MLP's ``fc`` GEMM is not, because ``MLP`` calls
``F.linear(x, fc.weight)`` itself. The serial block's two projections are fused with their
reduce-scatters. The parallel block's reduce-scatter takes attn + mlp summed, after both
projections, so it has no single GEMM to fuse with and runs unchunked.

Data parallel (DeepSpeed, see ``zero_overlap_settings``): ZeRO's ``overlap_comm`` reduces
gradient buckets on a side stream while the backward pass continues (ZeRO-2: every backward;
ZeRO-1: the backward at the accumulation boundary; under the pipeline engine, which runs the
backward outside ZeRO, after the last one). Prefetching the first
all-gather of an iteration exists only where an iteration starts with an all-gather, i.e. ZeRO-3
(``stage3_prefetch_bucket_size``: parameters are fetched ahead of the module that needs them,
in the order recorded during the first step). Under ZeRO-1/2 parameters stay whole between
steps: the only DP all-gather is the one that redistributes updated partitions at the end of
``step()``, bucketed by ``allgather_bucket_size``; DeepSpeed issues it synchronously there, so
MegaScale's "start it at the next iteration's first layer" has no hook in DeepSpeed 0.19.

Pipeline (DeepSpeed): its 1F1B executor uses blocking send/recv (``p2p.send`` asserts
``async_op == False``), so MegaScale's decoupled send/recv needs a patched schedule; the
``pp_decouple_send_recv`` switch is accepted and has no effect yet.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatrain.config import OverlapConfig


def chunk_bounds(length: int, chunks: int) -> list[tuple[int, int]]:
    """(offset, size) of ``chunks`` near-equal, non-empty pieces of ``range(length)``."""
    chunks = max(1, min(chunks, length))
    base, extra = divmod(length, chunks)
    bounds, offset = [], 0
    for i in range(chunks):
        size = base + (1 if i < extra else 0)
        bounds.append((offset, size))
        offset += size
    return bounds


def all_gather_flat(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False):
    """Ranks' inputs concatenated along dim 0 of ``output``: ``all_gather_single`` from torch
    2.13 on, ``all_gather_into_tensor`` (deprecated there) on the GPU image's torch 2.11."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, input, group=group, async_op=async_op)


def reduce_scatter_flat(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False):
    """Rank r gets the sum of block r (along dim 0) of every rank's ``input``."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(output, input, group=group, async_op=async_op)


def _start_all_gather(piece: torch.Tensor, world: int, group: dist.ProcessGroup):
    """Async all-gather of [B, n, d] pieces into [world, B, n, d]; returns (buffer, work)."""
    buffer = piece.new_empty((world * piece.shape[0], *piece.shape[1:]))  # gloo wants dim 0 = world * B
    work = all_gather_flat(buffer, piece.contiguous(), group, async_op=True)
    return buffer.view(world, *piece.shape), work


def _start_reduce_scatter(out: torch.Tensor, send: torch.Tensor, group: dist.ProcessGroup):
    """Async reduce-scatter of send [world, B, n, d] into out [B, n, d] (rank r gets send[r] summed)."""
    return reduce_scatter_flat(out, send.flatten(0, 1), group, async_op=True)


class _AllGatherMatmul(torch.autograd.Function):
    """x_local [B, s, d] (this rank's sequence shard) -> (x_full [B, t*s, d], x_full @ W_j^T ...).

    Full-sequence position r*s + i is row i of rank r's shard, so a piece [off, off+n) of every
    shard, once gathered, fills rows r*s + off ... of every rank r: the views [B, t, s, d] below.
    """

    @staticmethod
    def forward(ctx, x_local, group, chunks, *weights):
        world = dist.get_world_size(group)
        B, s, d = x_local.shape
        full = x_local.new_empty(B, world, s, d)
        outs = [x_local.new_empty(B, world, s, w.shape[0]) for w in weights]
        bounds = chunk_bounds(s, chunks)
        pending = _start_all_gather(x_local[:, 0 : bounds[0][1]], world, group)
        for k, (off, n) in enumerate(bounds):
            buffer, work = pending
            if k + 1 < len(bounds):  # the next piece travels while this one is multiplied
                nxt_off, nxt_n = bounds[k + 1]
                pending = _start_all_gather(x_local[:, nxt_off : nxt_off + nxt_n], world, group)
            work.wait()
            piece = buffer.transpose(0, 1)  # [B, t, n, d]
            full[:, :, off : off + n] = piece
            for out, weight in zip(outs, weights):
                out[:, :, off : off + n] = F.linear(piece, weight)
        ctx.group, ctx.bounds = group, bounds
        ctx.save_for_backward(full, *weights)
        return (full.view(B, world * s, d), *(out.view(B, world * s, -1) for out in outs))

    @staticmethod
    def backward(ctx, grad_full, *grad_outs):
        full, *weights = ctx.saved_tensors
        B, world, s, d = full.shape
        grad_full = grad_full.reshape(B, world, s, d)
        grad_outs = [g.reshape(B, world, s, -1) for g in grad_outs]
        grad_local = full.new_empty(B, s, d)
        in_flight = []
        for off, n in ctx.bounds:
            rows = slice(off, off + n)
            dx = grad_full[:, :, rows].clone()
            for grad_out, weight in zip(grad_outs, weights):
                dx += grad_out[:, :, rows] @ weight
            recv = full.new_empty(B, n, d)
            work = _start_reduce_scatter(recv, dx.transpose(0, 1).contiguous(), ctx.group)
            in_flight.append((work, recv, rows))
        # Weight gradients need no communication: they run while the last reduce-scatters travel.
        flat_full = full.reshape(-1, d)
        grad_weights = [g.reshape(-1, g.shape[-1]).t() @ flat_full for g in grad_outs]
        for work, recv, rows in in_flight:
            work.wait()
            grad_local[:, rows] = recv
        return (grad_local, None, None, *grad_weights)


class _MatmulReduceScatter(torch.autograd.Function):
    """x [B, t*s, k_local] @ W^T [k_local, d], summed over the TP group and split along the
    sequence: -> [B, s, d]. Row piece [off, off+n) of every rank's destination shard is one
    chunk: computed, then reduce-scattered while the next chunk is computed."""

    @staticmethod
    def forward(ctx, x, weight, group, chunks):
        world = dist.get_world_size(group)
        B, T, k = x.shape
        s = T // world
        rows_by_rank = x.reshape(B, world, s, k)
        bounds = chunk_bounds(s, chunks)
        out = x.new_empty(B, s, weight.shape[0])
        in_flight = []
        for off, n in bounds:
            send = F.linear(rows_by_rank[:, :, off : off + n], weight).transpose(0, 1).contiguous()  # [t, B, n, d]
            recv = x.new_empty(B, n, weight.shape[0])
            in_flight.append((_start_reduce_scatter(recv, send, group), recv, off, n))
        for work, recv, off, n in in_flight:
            work.wait()
            out[:, off : off + n] = recv
        ctx.group, ctx.bounds = group, bounds
        ctx.save_for_backward(x, weight)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        world = dist.get_world_size(ctx.group)
        B, T, k = x.shape
        s = T // world
        rows_by_rank = x.reshape(B, world, s, k)
        grad_x = x.new_empty(B, world, s, k)
        grad_weight = torch.zeros_like(weight)
        bounds = ctx.bounds
        pending = _start_all_gather(grad_out[:, 0 : bounds[0][1]], world, ctx.group)
        for i, (off, n) in enumerate(bounds):
            buffer, work = pending
            if i + 1 < len(bounds):
                nxt_off, nxt_n = bounds[i + 1]
                pending = _start_all_gather(grad_out[:, nxt_off : nxt_off + nxt_n], world, ctx.group)
            work.wait()
            g = buffer.transpose(0, 1)  # [B, t, n, d]
            grad_x[:, :, off : off + n] = g @ weight
            grad_weight += g.reshape(-1, g.shape[-1]).t() @ rows_by_rank[:, :, off : off + n].reshape(-1, k)
        return grad_x.view(B, T, k), grad_weight, None, None


def all_gather_matmul(
    x_local: torch.Tensor, weights: list[torch.Tensor], group: dist.ProcessGroup, chunks: int
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """All-gather a sequence shard [B, s, d] over ``group`` and multiply it by each weight
    ([n_j, d], no bias), pipelined in ``chunks`` pieces. Returns (x_full, [x_full @ W_j^T])."""
    full, *outs = _AllGatherMatmul.apply(x_local, group, chunks, *weights)
    return full, outs


def matmul_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, group: dist.ProcessGroup, chunks: int) -> torch.Tensor:
    """(x @ weight^T) summed over ``group`` and split along the sequence, pipelined in
    ``chunks`` pieces: x [B, T, k_local], weight [d, k_local] -> [B, T / t, d]."""
    return _MatmulReduceScatter.apply(x, weight, group, chunks)


def zero_overlap_settings(overlap: OverlapConfig, zero_stage: int, bucket: int) -> dict:
    """The ZeRO entries that overlap data-parallel communication (see the module docstring)."""
    settings: dict = {"overlap_comm": overlap.dp_overlap_comm}
    if zero_stage == 3:
        settings["stage3_prefetch_bucket_size"] = bucket if overlap.dp_prefetch else 0
    return settings
