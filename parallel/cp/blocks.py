"""Attention of one rank's queries against one rank's keys and values: which parts are
computed (a plan, pure data), the forward with its log-sum-exp, the merge rule, and the
exact backward. No communication: :mod:`.ring` and :mod:`.all_gather` move the blocks.

Blockwise softmax (Milakov and Gimelshein 2018, arXiv 1805.02867; FlashAttention, arXiv
2205.14135). For the scores S_j = q K_jᵀ · scale of key block j, with
``lse_j = logsumexp(S_j)`` per query row and ``o_j = softmax(S_j) V_j``, the attention over
all blocks is::

    lse = logaddexp(lse_a, lse_b)
    o   = exp(lse_a - lse) * o_a + exp(lse_b - lse) * o_b

whatever the order, so the blocks can arrive in any order. Backward, with the final o
and lse and ``D = rowsum(dO * o)``: ``P_j = exp(S_j - lse)``, ``dV_j = P_jᵀ dO``,
``dS_j = P_j * (dO V_jᵀ - D)``, ``dq += dS_j K_j · scale``, ``dK_j = dS_jᵀ q · scale``.

Everything is accumulated in float32, or float64 for float64 inputs: a bfloat16 softmax
of a long row loses most of its digits.

The causal mask is on global positions. Each rank's tokens are whole chunks of the
sequence (:mod:`.layout`), so a pair of chunks is either fully visible (query chunk after
key chunk), on the diagonal (same chunk: masked inside), or fully masked (skipped, never
computed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .layout import chunks_of, positions_of

__all__ = ["Part", "accumulation_dtype", "attend", "attend_backward", "merge", "plan",
           "work_of"]


#: Query rows computed at once: bounds the scores' memory, (b, h, TILE_ROWS, keys).
TILE_ROWS = 1024


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 for float64 inputs, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class Part:
    """One computed piece of a block: query rows ``[q_start, q_stop)`` of this rank against
    key rows ``[k_start, k_stop)`` of the block's owner; ``masked`` when it holds a
    diagonal chunk (the causal mask applies inside it)."""

    q_start: int
    q_stop: int
    k_start: int
    k_stop: int
    masked: bool

    @property
    def work(self) -> int:
        """Score entries computed: query rows x key rows (FLOPs up to a constant)."""
        return (self.q_stop - self.q_start) * (self.k_stop - self.k_start)


def plan(q_rank: int, kv_rank: int, size: int, local_length: int, layout: str,
         causal: bool) -> tuple:
    """The parts of the block (q_rank's queries, kv_rank's keys) that are computed.

    Without a mask: one part, everything. With a causal mask, for each of the query
    rank's chunks, the key chunks at or before it (adjacent ones merged into one part);
    chunks after it are skipped. Two ranks, zigzag, 8 tokens: ``plan(0, 1, 2, 4, "zigzag",
    True)`` is ``(Part(2, 4, 0, 4, False),)``: chunk 3 of rank 0 sees rank 1's chunks 1 and
    2; chunk 0 sees none of them.
    """
    if not causal:
        return (Part(0, local_length, 0, local_length, False),)
    q_chunks, k_chunks = chunks_of(q_rank, size, layout), chunks_of(kv_rank, size, layout)
    qn, kn = local_length // len(q_chunks), local_length // len(k_chunks)
    parts = []
    for i, qc in enumerate(q_chunks):
        seen = [j for j, kc in enumerate(k_chunks) if kc <= qc]
        if not seen:
            continue                                   # fully masked: skipped
        # Chunks at or before a query chunk are a contiguous run of the owner's chunks
        # (its first chunk precedes its second), so one part covers them.
        parts.append(Part(i * qn, (i + 1) * qn, seen[0] * kn, (seen[-1] + 1) * kn,
                          any(k_chunks[j] == qc for j in seen)))
    return tuple(parts)


def work_of(rank: int, size: int, local_length: int, layout: str, causal: bool) -> int:
    """The score entries rank ``rank`` computes in one forward, over every block."""
    return sum(p.work for src in range(size)
               for p in plan(rank, src, size, local_length, layout, causal))


def _mask(part: Part, q_rank: int, kv_rank: int, size: int, local_length: int,
          layout: str) -> Optional[torch.Tensor]:
    """True where a query may see a key, for a part on the diagonal (else None)."""
    if not part.masked:
        return None
    q_pos = positions_of(q_rank, size, local_length, layout)[part.q_start:part.q_stop]
    k_pos = positions_of(kv_rank, size, local_length, layout)[part.k_start:part.k_stop]
    return q_pos[:, None] >= k_pos[None, :]


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float,
            mask: Optional[torch.Tensor]) -> torch.Tensor:
    s = torch.matmul(q, k.transpose(-1, -2)) * scale     # (b, h, sq, d) @ (b, h, d, sk)
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
           mask: Optional[torch.Tensor]) -> tuple:
    """(o, lse) of queries ``q`` against one block (all in the accumulation dtype): o of
    shape (b, h, sq, d), lse (b, h, sq). Every row sees at least one key."""
    s = _scores(q, k, scale, mask)
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v), lse   # (b,h,sq,sk)@(b,h,sk,d)


def merge(out: torch.Tensor, lse: torch.Tensor, o: torch.Tensor, lse_b: torch.Tensor) -> None:
    """Fold a block's (o, lse_b) into the running (out, lse) in place. Rows not seen yet
    have lse = -inf and out = 0: their weight exp(-inf) is 0."""
    new = torch.logaddexp(lse, lse_b)
    out.mul_(torch.exp(lse - new).unsqueeze(-1)).add_(torch.exp(lse_b - new).unsqueeze(-1) * o)
    lse.copy_(new)


def attend_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
                    lse: torch.Tensor, delta: torch.Tensor, scale: float,
                    mask: Optional[torch.Tensor]) -> tuple:
    """(dq, dk, dv) of one block, given the final ``lse`` and ``delta = rowsum(dout*out)``
    of the query rows (all in the accumulation dtype)."""
    p = torch.exp(_scores(q, k, scale, mask) - lse.unsqueeze(-1))   # (b, h, sq, sk)
    dv = torch.matmul(p.transpose(-1, -2), dout)                    # (b, h, sk, d)
    ds = p * (torch.matmul(dout, v.transpose(-1, -2)) - delta.unsqueeze(-1))
    dq = torch.matmul(ds, k) * scale                                # (b, h, sq, d)
    dk = torch.matmul(ds.transpose(-1, -2), q) * scale              # (b, h, sk, d)
    return dq, dk, dv


class BlockAttention:
    """One rank's side of the blockwise attention: its queries (and, in backward, their
    output's gradient) in the accumulation dtype, and the running results, fed one key
    block at a time by a communication pattern (ring or all-gather)."""

    def __init__(self, q: torch.Tensor, rank: int, size: int, layout: str, causal: bool,
                 scale: float) -> None:
        self.acc = accumulation_dtype(q.dtype)
        self.q = q.to(self.acc)
        self.rank, self.size, self.layout, self.causal = rank, size, layout, causal
        self.scale, self.length = scale, q.shape[-2]

    def parts(self, src: int) -> list:
        """(part, mask) for each computed part of the block owned by ``src``, in tiles of
        at most :data:`TILE_ROWS` query rows (so that a long block's scores never take
        more than TILE_ROWS x its keys at once)."""
        tiles = [Part(lo, min(lo + TILE_ROWS, p.q_stop), p.k_start, p.k_stop, p.masked)
                 for p in plan(self.rank, src, self.size, self.length, self.layout,
                               self.causal)
                 for lo in range(p.q_start, p.q_stop, TILE_ROWS)]
        masks = [_mask(t, self.rank, src, self.size, self.length, self.layout) for t in tiles]
        # (positions are made on the CPU; scores live on q's device, a GPU's too)
        return [(t, None if m is None else m.to(self.q.device)) for t, m in zip(tiles, masks)]

    def forward(self, kv: torch.Tensor, src: int, out: torch.Tensor,
                lse: torch.Tensor) -> None:
        """Fold block ``src`` (``kv`` = stack(k, v)) into (out, lse)."""
        k, v = kv[0].to(self.acc), kv[1].to(self.acc)
        for p, mask in self.parts(src):
            rows = slice(p.q_start, p.q_stop)
            o, lse_b = attend(self.q[..., rows, :], k[..., p.k_start:p.k_stop, :],
                              v[..., p.k_start:p.k_stop, :], self.scale, mask)
            merge(out[..., rows, :], lse[..., rows], o, lse_b)

    def backward(self, kv: torch.Tensor, src: int, dout: torch.Tensor, lse: torch.Tensor,
                 delta: torch.Tensor, dq: torch.Tensor) -> torch.Tensor:
        """Add block ``src``'s share to ``dq``; return its stack(dk, dv) from these
        queries (accumulation dtype; zero where skipped)."""
        k, v = kv[0].to(self.acc), kv[1].to(self.acc)
        dkv = torch.zeros(kv.shape, dtype=self.acc, device=kv.device)
        for p, mask in self.parts(src):
            rows, keys = slice(p.q_start, p.q_stop), slice(p.k_start, p.k_stop)
            dq_b, dk_b, dv_b = attend_backward(
                self.q[..., rows, :], k[..., keys, :], v[..., keys, :], dout[..., rows, :],
                lse[..., rows], delta[..., rows], self.scale, mask)
            dq[..., rows, :] += dq_b
            dkv[0][..., keys, :] += dk_b
            dkv[1][..., keys, :] += dv_b
        return dkv
