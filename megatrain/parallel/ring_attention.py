"""Ring attention: causal (and windowed, and document-masked) attention over a sequence whose tokens
are spread over the ``cp`` ranks of a context-parallel group.

Each rank holds two chunks of every sample (``context_parallel.chunk_positions``: chunk r and chunk
2 cp - 1 - r of 2 cp equal chunks, so every rank has the same share of the causal work). Its queries
stay; the keys and values travel: at step s a rank holds the K/V block of rank r - s, computes the
attention of its queries to it while the block moves on to rank r + 1 (send/recv started before
the compute), and merges the partial result into its own by log-sum-exp (online softmax):
lse = logaddexp(lse_a, lse_b), out = out_a e^(lse_a - lse) + out_b e^(lse_b - lse). Within a block
the work is done per (query chunk, key chunk) pair, and a pair the mask hides whole (a key chunk
after the query chunk, or farther than the window) is skipped. Document ids travel with the block:
they were computed on the whole sample, so comparing them is exact across ranks.

The backward is explicit (a ``torch.autograd.Function``): with the forward's output and final lse
saved, each block's probabilities are recomputed, p = exp(s - lse), and the standard attention
gradients follow (D = rowsum(dO * O), dS = P * (dO V^T - D)). dQ stays; dK and dV of a block are
accumulated into buffers that travel around the ring with it and, after cp shifts, arrive back
at the rank that owns the block. Per-block math is plain torch in fp32 here (exact on CPU, the
reference a fused kernel would be held to).

GQA: k and v keep their H_kv heads on the wire; they are repeated for the compute and the
gradients summed back over each KV head's query heads.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


def chunk_ids(cp: int, rank: int) -> tuple[int, int]:
    """The two chunks (of 2 cp) a cp rank holds: the causal load balancing."""
    return rank, 2 * cp - 1 - rank


def ring_exchange(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> tuple[list, list[torch.Tensor]]:
    """Start sending ``tensors`` to the next cp rank and receiving their likes from the previous one.
    Returns (requests, receive buffers); wait on the requests before reading the buffers."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    nxt, prv = dist.get_global_rank(group, (rank + 1) % cp), dist.get_global_rank(group, (rank - 1) % cp)
    tensors = [t.contiguous() for t in tensors]
    received = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, nxt, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, buf, prv, group) for buf in received]
    return dist.batch_isend_irecv(ops), received


def _wait(requests: list) -> None:
    for request in requests:
        request.wait()



def _visible_pairs(cp: int, r: int, src: int, c: int, window, q_doc, k_doc, device):
    """(query slice, key slice, mask) for each pair of rank r's chunks and rank src's that is not
    fully masked: forward and backward walk the same pairs."""
    for a, qc in enumerate(chunk_ids(cp, r)):
        qs = slice(a * c, (a + 1) * c)
        for b, kc in enumerate(chunk_ids(cp, src)):
            ks = slice(b * c, (b + 1) * c)
            mask = _pair_mask(qc, kc, c, window, None if q_doc is None else q_doc[:, qs],
                              None if k_doc is None else k_doc[:, ks], device)
            if mask is not False:
                yield qs, ks, mask

def _pair_mask(qc: int, kc: int, c: int, window: int | None, q_doc: torch.Tensor | None,
               k_doc: torch.Tensor | None, device: torch.device) -> torch.Tensor | None | bool:
    """Mask of query chunk qc against key chunk kc (chunk size c): False when the pair is hidden
    whole (skipped), None when all visible, else a boolean [B or 1, 1, c, c]."""
    if kc > qc:
        return False
    if window is not None and (qc - kc - 1) * c + 1 >= window:  # nearest pair already outside the window
        return False
    mask = None
    if kc == qc or (window is not None and (qc - kc + 1) * c - 1 >= window):
        i = torch.arange(qc * c, (qc + 1) * c, device=device)[:, None]
        j = torch.arange(kc * c, (kc + 1) * c, device=device)[None, :]
        allowed = j <= i
        if window is not None:
            allowed = allowed & ((i - j) < window)
        mask = allowed[None, None]
    if q_doc is not None:
        same = (q_doc[:, :, None] == k_doc[:, None, :])[:, None]  # [B, 1, c, c]
        mask = same if mask is None else mask & same
    return mask


def _scores(q: torch.Tensor, k: torch.Tensor, mask, scale: float) -> torch.Tensor:
    s = (q @ k.transpose(-2, -1)) * scale  # [B, H, c, c] fp32
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


def _merge(out: torch.Tensor, lse: torch.Tensor, blk_out: torch.Tensor, blk_lse: torch.Tensor) -> None:
    """Online softmax: fold a block's (normalised out, lse) into the running pair, in place."""
    new = torch.logaddexp(lse, blk_lse)
    safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)  # rows no key reached yet
    out.mul_(torch.exp(lse - safe)[..., None]).add_(blk_out * torch.exp(blk_lse - safe)[..., None])
    lse.copy_(new)


def _repeat(x: torch.Tensor, n_head: int) -> torch.Tensor:
    return x.repeat_interleave(n_head // x.shape[1], dim=1)


def _unrepeat(dx: torch.Tensor, n_kv: int) -> torch.Tensor:
    B, H, T, hd = dx.shape
    return dx.view(B, n_kv, H // n_kv, T, hd).sum(2)


class RingAttention(torch.autograd.Function):
    """q [B, H, 2c, hd], k, v [B, G, 2c, hd] (this rank's two chunks), doc_ids [B, 2c] or None -> [B, H, 2c, hd]."""

    @staticmethod
    def forward(ctx, q, k, v, doc_ids, window, group):
        cp, r = dist.get_world_size(group), dist.get_rank(group)
        B, H, T, hd = q.shape
        c, scale = T // 2, 1.0 / math.sqrt(hd)
        qf = q.float()
        out = torch.zeros(B, H, T, hd, dtype=torch.float32, device=q.device)
        lse = torch.full((B, H, T), float("-inf"), dtype=torch.float32, device=q.device)
        blocks = [k, v] + ([doc_ids] if doc_ids is not None else [])
        for step in range(cp):
            src = (r - step) % cp
            pending = ring_exchange(blocks, group) if step < cp - 1 else None  # the next block travels meanwhile
            kb, vb = _repeat(blocks[0].float(), H), _repeat(blocks[1].float(), H)
            kdoc = blocks[2] if doc_ids is not None else None
            for qs, ks, mask in _visible_pairs(cp, r, src, c, window, doc_ids, kdoc, q.device):
                s = _scores(qf[:, :, qs], kb[:, :, ks], mask, scale)
                blk_lse = torch.logsumexp(s, -1)  # [B, H, c]
                safe = torch.where(torch.isinf(blk_lse), torch.zeros_like(blk_lse), blk_lse)
                blk_out = torch.exp(s - safe[..., None]) @ vb[:, :, ks]
                _merge(out[:, :, qs], lse[:, :, qs], blk_out, blk_lse)
            if pending is not None:
                _wait(pending[0])
                blocks = pending[1]
        ctx.save_for_backward(q, k, v, out, lse, *([doc_ids] if doc_ids is not None else []))
        ctx.window, ctx.group, ctx.has_doc = window, group, doc_ids is not None
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, *rest = ctx.saved_tensors
        doc_ids = rest[0] if ctx.has_doc else None
        group, window = ctx.group, ctx.window
        cp, r = dist.get_world_size(group), dist.get_rank(group)
        B, H, T, hd = q.shape
        G, c, scale = k.shape[1], T // 2, 1.0 / math.sqrt(hd)
        qf, do = q.float(), dout.float()
        delta = (do * out).sum(-1)  # [B, H, T]: rowsum(dO * O)
        dq = torch.zeros_like(qf)
        dkv = [torch.zeros(B, G, T, hd, dtype=torch.float32, device=q.device) for _ in range(2)]  # travel with the block
        blocks = [k, v] + ([doc_ids] if doc_ids is not None else [])
        for step in range(cp):
            src = (r - step) % cp
            pending = ring_exchange(blocks, group) if step < cp - 1 else None
            kb, vb = _repeat(blocks[0].float(), H), _repeat(blocks[1].float(), H)
            kdoc = blocks[2] if doc_ids is not None else None
            dk_rep, dv_rep = torch.zeros_like(kb), torch.zeros_like(vb)
            for qs, ks, mask in _visible_pairs(cp, r, src, c, window, doc_ids, kdoc, q.device):
                s = _scores(qf[:, :, qs], kb[:, :, ks], mask, scale)
                p = torch.exp(s - lse[:, :, qs, None])  # [B, H, c, c], the forward's probabilities
                dv_rep[:, :, ks] += p.transpose(-2, -1) @ do[:, :, qs]
                ds = p * (do[:, :, qs] @ vb[:, :, ks].transpose(-2, -1) - delta[:, :, qs, None])
                dq[:, :, qs] += (ds @ kb[:, :, ks]) * scale
                dk_rep[:, :, ks] += (ds.transpose(-2, -1) @ qf[:, :, qs]) * scale
            dkv[0] += _unrepeat(dk_rep, G)
            dkv[1] += _unrepeat(dv_rep, G)
            if pending is not None:
                _wait(pending[0])
                blocks = pending[1]
            if cp > 1:  # the block's gradients follow it; after cp shifts they are home
                requests, dkv = ring_exchange(dkv, group)
                _wait(requests)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None,
                   doc_ids: torch.Tensor | None, group: dist.ProcessGroup) -> torch.Tensor:
    """q [B, H, 2c, hd], k, v [B, G, 2c, hd]: this cp rank's chunks (``chunk_ids``) -> [B, H, 2c, hd]."""
    return RingAttention.apply(q, k, v, doc_ids, window, group)
