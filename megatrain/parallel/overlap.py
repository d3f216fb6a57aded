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
``tp_chunks=1`` turns this off: the plain regions of tp_collectives.py are used. Only sequence
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

ZeRO-0 (plain data parallelism, what a 1-2 GPU recipe with LAMB picks: no flat partitions, so
LAMB keeps its fused per-tensor kernel): DeepSpeed all-reduces every gradient after the backward
pass (``engine.allreduce_gradients``), with nothing to overlap. ``attach_dp_overlap`` replaces
that with torch DDP's scheme (``DataParallelGradReducer``): gradients are packed into buckets in
the order backward produces them, and each full bucket's all-reduce starts on NCCL's stream while
the backward pass goes on; the end of the backward waits for the last ones. It needs the trainer
to call it once after ``deepspeed.initialize``, which it does not (yet): measured on two NVLinked
H200s (1.3B, micro-batch 16, benchmarks/RESULTS.md) it was 0.7-5% slower than DeepSpeed's
all-reduce after backward, which exposes only ~8 ms of a 550 ms step there; the overlapped NCCL
kernels slow the backward's GEMMs by more (also with an 8-CTA communicator, ``max_ctas``). It is
for interconnects where the all-reduce is long enough to be worth hiding (between nodes).

Measured there too, for tensor parallelism over NVLink: chunking (``tp_chunks`` 2 and 4) was
8% and 16% slower per step than ``tp_chunks=1``; one all-gather or reduce-scatter of a layer
takes well under a millisecond, less than the extra copies and smaller GEMMs cost.

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


# ---------------------------------------------------------------- data parallel, ZeRO-0


class _Bucket:
    def __init__(self, params: list[torch.Tensor]):
        self.params = params
        self.numel = sum(p.numel() for p in params)
        self.buffer: torch.Tensor | None = None  # allocated at the first reduction
        self.views: list[torch.Tensor] = []
        self.ready: set[int] = set()
        self.work = None

    def allocate(self) -> None:
        first = self.params[0]
        self.buffer = torch.empty(self.numel, dtype=first.dtype, device=first.device)
        self.views, offset = [], 0
        for p in self.params:
            self.views.append(self.buffer[offset : offset + p.numel()].view_as(p))
            offset += p.numel()


def make_buckets(params: list[torch.Tensor], bucket_numel: int) -> list[_Bucket]:
    """Parameters in reverse order, cut into buckets of at most ``bucket_numel`` elements (a larger
    parameter gets a bucket of its own), one dtype and device per bucket."""
    buckets: list[_Bucket] = []
    current: list[torch.Tensor] = []
    for p in reversed(params):
        if current and (sum(q.numel() for q in current) + p.numel() > bucket_numel
                        or (p.dtype, p.device) != (current[0].dtype, current[0].device)):
            buckets.append(_Bucket(current))
            current = []
        current.append(p)
    if current:
        buckets.append(_Bucket(current))
    return buckets


class DataParallelGradReducer:
    """All-reduce (average) gradients over ``group`` in buckets while the backward pass runs.

    Buckets hold parameters in reverse registration order (about the order backward produces
    their gradients) up to ``bucket_numel`` elements, one dtype and device each. A parameter's
    post-accumulate-grad hook copies its gradient into its bucket; when every parameter of a
    bucket is in, the bucket's all-reduce starts (async). A callback at the end of the backward
    pass starts any bucket still incomplete (parameters without a gradient count as zeros),
    waits for all of them and makes each ``param.grad`` a view of its reduced bucket. Only the
    backward passes for which ``is_boundary()`` is true reduce (gradient accumulation: the last
    micro-batch of a step); the others accumulate locally as usual.
    """

    def __init__(self, params: list[torch.Tensor], group: dist.ProcessGroup | None, bucket_numel: int,
                 is_boundary=lambda: True):
        self.group = group
        self.world = dist.get_world_size(group)
        self.is_boundary = is_boundary
        self.average_op = dist.ReduceOp.AVG if dist.get_backend(group) == "nccl" else None
        params = [p for p in params if p.requires_grad]
        if len({id(p) for p in params}) != len(params):
            raise ValueError("DataParallelGradReducer: a parameter is listed twice")
        self.buckets = make_buckets(params, bucket_numel)
        self._where = {id(p): (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        self._queued = False
        self.handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    def _on_grad(self, param: torch.Tensor) -> None:
        if not self.is_boundary():
            return
        bucket, _ = self._where[id(param)]
        if id(param) in bucket.ready or bucket.work is not None:
            raise RuntimeError("DataParallelGradReducer: a gradient arrived twice in one backward pass "
                               "(after its bucket was reduced)")
        if not self._queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self._queued = True
        bucket.ready.add(id(param))
        if len(bucket.ready) == len(bucket.params):
            self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        if bucket.buffer is None:
            bucket.allocate()
        dst, src = [], []
        for p, view in zip(bucket.params, bucket.views):
            if p.grad is None:
                view.zero_()
            elif p.grad.data_ptr() != view.data_ptr():
                dst.append(view)
                src.append(p.grad)
        if dst:
            torch._foreach_copy_(dst, src)
        if self.average_op is not None:
            bucket.work = dist.all_reduce(bucket.buffer, op=self.average_op, group=self.group, async_op=True)
        else:  # gloo has no AVG
            bucket.buffer.div_(self.world)
            bucket.work = dist.all_reduce(bucket.buffer, group=self.group, async_op=True)

    def _finish(self) -> None:
        self._queued = False
        for bucket in self.buckets:
            if bucket.work is None:
                self._launch(bucket)
        for bucket in self.buckets:
            bucket.work.wait()
            for p, view in zip(bucket.params, bucket.views):
                p.grad = view
            bucket.work = None
            bucket.ready.clear()


def dp_bucket_numel(n_params: int) -> int:
    """About 1/32 of the model per bucket, 5M..100M elements: enough collectives to overlap the
    backward pass, each large enough for full NVLink bandwidth; the bucket that completes last
    (and cannot overlap anything) stays small."""
    return int(min(1e8, max(5e6, n_params // 32)))


def dp_reduce_group(groups, max_ctas: int | None) -> dist.ProcessGroup | None:
    """The group the overlapped all-reduces use: the DP group itself, or (NCCL, ``max_ctas`` set)
    a second communicator over the same ranks whose collectives use at most ``max_ctas`` thread
    blocks, so that they take fewer SMs from the backward pass they run beside (Megatron-LM's
    ``nccl_comm_cfgs``). Collective: every rank calls it with the same arguments."""
    if max_ctas is None or not dist.is_initialized() or dist.get_backend(groups.dp_group) != "nccl":
        return groups.dp_group
    options = dist.ProcessGroupNCCL.Options(is_high_priority_stream=True)
    options.config.max_ctas = max_ctas
    options.config.min_ctas = 1
    mine = groups.dp_group
    for ranks in groups.dims.dp_groups():  # every rank creates every group, in the same order
        group = dist.new_group(ranks, backend="nccl", pg_options=options)
        if groups.rank in ranks:
            mine = group
    return mine


def attach_dp_overlap(engine, cfg, groups, max_ctas: int | None = None) -> DataParallelGradReducer | None:
    """Overlap ZeRO-0's gradient all-reduce with the backward pass (see the module docstring).
    Call once after ``deepspeed.initialize``; returns None where it does not apply: ZeRO-1/2/3
    (DeepSpeed's ``overlap_comm`` does it there), dp == 1, a pipeline engine (it reduces after its
    schedule), or ``parallel.overlap.dp_overlap_comm`` off. ``max_ctas``: see ``dp_reduce_group``."""
    p = cfg.parallel
    if p.zero_stage != 0 or groups.dims.dp == 1 or groups.dims.pp > 1 or not p.overlap.dp_overlap_comm:
        return None
    params = [q for q in engine.module.parameters() if q.requires_grad]
    reducer = DataParallelGradReducer(params, dp_reduce_group(groups, max_ctas),
                                      dp_bucket_numel(sum(q.numel() for q in params)),
                                      is_boundary=engine.is_gradient_accumulation_boundary)
    engine.enable_backward_allreduce = False  # DeepSpeed's all-reduce after backward: done above instead
    return reducer
