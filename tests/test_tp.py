"""parallel.tp: every tensor-parallel layer equals its dense single-process module, in its
outputs and in the gradients of its inputs, weights and biases, to float32 tolerance.

The checks are functions of a process group and of a case (sizes and a seed, drawn by
hypothesis in the driver; every rank builds the same dense module and data from the
seed with its own ``torch.Generator``, never the global random state, which the threads
of one process share). They run in the in-process thread world for the properties (world
sizes 1 to 4), and as one job per backend in real processes: ``collectives.spawn`` for
shm, zmq and gloo, ``mpiexec`` running this file for mpi. Every check returns plain
floats and digests, so a result travels back from any process as JSON.

An error is ``max |tp - dense| / (ATOL * scale + RTOL * |dense|)``: at most 1 passes.
``scale`` is 1, except in a transformer block, where the absolute part scales with the
magnitudes involved: ``scale = max(1, the largest of all its outputs and gradients)``.
There a small element that is the difference of large products carries the rounding
of those products, which the tensor-parallel and the dense matmuls accumulate in
different orders (on an AVX-512 machine: 0.0165 off by 1.8e-5 in a gradient whose
largest element is 47.6; the key bias's gradient, zero but for rounding since softmax
ignores a shift shared by a row, off by 1e-5).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from job_env import job_env
import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script under mpiexec
    sys.path.insert(0, str(ROOT))

import collectives  # noqa: E402
from collectives.testing.threads import run_threads  # noqa: E402
from parallel.tp import (ColumnParallelLinear, ParallelTransformerBlock,  # noqa: E402
                         RowParallelLinear, TransformerBlock, VocabParallelEmbedding,
                         copy_to, gather_from, gather_from_sequence, reduce_from,
                         reduce_scatter_to_sequence, scatter_to, scatter_to_sequence,
                         vocab_parallel_cross_entropy)

RTOL, ATOL = 1e-4, 1e-5
MPIEXEC = shutil.which(os.environ.get("MPIEXEC") or "mpiexec") or shutil.which("mpirun")


# ------------------------------------------------------------------ helpers
def _err(tp: torch.Tensor, dense: torch.Tensor, scale: float = 1.0) -> float:
    """How far ``tp`` is from ``dense``, in units of the tolerance (<= 1 passes);
    ``scale``: the magnitude the absolute part is relative to (at least 1)."""
    if tp.shape != dense.shape:
        return float("inf")
    if tp.numel() == 0:
        return 0.0
    scale = max(1.0, scale)
    return ((tp - dense).abs() / (ATOL * scale + RTOL * dense.abs())).max().item()


def _digest(t: torch.Tensor) -> str:
    """Equal on two ranks iff their tensors are bitwise equal."""
    return hashlib.sha1(t.detach().contiguous().numpy().tobytes()).hexdigest()


def _fill(module: nn.Module, gen: torch.Generator, scale: float = 0.5) -> nn.Module:
    """Random parameters from ``gen`` (LayerNorm weights around 1)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * scale)
            if isinstance(module, nn.LayerNorm) or name.startswith("ln") and "weight" in name:
                p.add_(1.0)
    return module


def _block_of(t: torch.Tensor, dim: int, group) -> torch.Tensor:
    return t.chunk(group.size, dim)[group.rank]


# ------------------------------------------------------------------ checks (per rank)
def check_linear(pg, case: dict) -> dict:
    """ColumnParallelLinear, RowParallelLinear and the column+row MLP against nn.Linear.
    ``case``: seed, lead (the leading dims of the input), d_in, hidden (a multiple of the
    group size), d_out, bias, gather_output, input_is_parallel."""
    gen = torch.Generator().manual_seed(case["seed"])
    lead, d_in, hid, d_out = tuple(case["lead"]), case["d_in"], case["hidden"], case["d_out"]
    fc1 = _fill(nn.Linear(d_in, hid, bias=case["bias"]), gen)
    fc2 = _fill(nn.Linear(hid, d_out, bias=case["bias"]), gen)
    x = torch.randn(*lead, d_in, generator=gen)
    h_in = torch.randn(*lead, hid, generator=gen)   # the row layer's own input
    seed_out = torch.randn(*lead, d_out, generator=gen)
    errs, digests = {}, {}

    # column alone
    col = ColumnParallelLinear.from_dense(fc1, pg, gather_output=case["gather_output"])
    xt, xd = x.clone().requires_grad_(), x.clone().requires_grad_()
    yt, yd = col(xt), fc1(xd)
    w_out = torch.randn(*lead, hid, generator=gen)
    (yt * (w_out if case["gather_output"] else _block_of(w_out, -1, pg))).sum().backward()
    (yd * w_out).sum().backward()
    errs["col.y"] = _err(yt, yd if case["gather_output"] else _block_of(yd, -1, pg))
    errs["col.dx"] = _err(xt.grad, xd.grad)
    errs["col.dw"] = _err(col.weight.grad, _block_of(fc1.weight.grad, 0, pg))
    if case["bias"]:
        errs["col.db"] = _err(col.bias.grad, _block_of(fc1.bias.grad, 0, pg))
    digests["col.dx"] = _digest(xt.grad)
    fc1.zero_grad()

    # row alone
    row = RowParallelLinear.from_dense(fc2, pg, input_is_parallel=case["input_is_parallel"])
    ht, hd = h_in.clone().requires_grad_(), h_in.clone().requires_grad_()
    yt = row(_block_of(ht, -1, pg) if case["input_is_parallel"] else ht)
    yd = fc2(hd)
    (yt * seed_out).sum().backward()
    (yd * seed_out).sum().backward()
    errs["row.y"] = _err(yt, yd)
    if case["input_is_parallel"]:  # the gradient of this rank's block
        errs["row.dx"] = _err(_block_of(ht.grad, -1, pg), _block_of(hd.grad, -1, pg))
    else:                          # scatter_to's backward gathered the whole gradient
        errs["row.dx"] = _err(ht.grad, hd.grad)
    errs["row.dw"] = _err(row.weight.grad, _block_of(fc2.weight.grad, 1, pg))
    if case["bias"]:
        errs["row.db"] = _err(row.bias.grad, fc2.bias.grad)
    digests["row.y"] = _digest(yt)
    fc2.zero_grad()

    # the MLP: column, ReLU, row
    c1, r2 = ColumnParallelLinear.from_dense(fc1, pg), RowParallelLinear.from_dense(fc2, pg)
    xt, xd = x.clone().requires_grad_(), x.clone().requires_grad_()
    yt, yd = r2(torch.relu(c1(xt))), fc2(torch.relu(fc1(xd)))
    (yt * seed_out).sum().backward()
    (yd * seed_out).sum().backward()
    errs["mlp.y"] = _err(yt, yd)
    errs["mlp.dx"] = _err(xt.grad, xd.grad)
    errs["mlp.dw1"] = _err(c1.weight.grad, _block_of(fc1.weight.grad, 0, pg))
    errs["mlp.dw2"] = _err(r2.weight.grad, _block_of(fc2.weight.grad, 1, pg))
    if case["bias"]:
        errs["mlp.db1"] = _err(c1.bias.grad, _block_of(fc1.bias.grad, 0, pg))
        errs["mlp.db2"] = _err(r2.bias.grad, fc2.bias.grad)
    digests["mlp.y"], digests["mlp.dx"] = _digest(yt), _digest(xt.grad)

    # to_dense gives back the layers, exactly
    errs["to_dense"] = 0.0 if all(
        torch.equal(a, b) for a, b in zip(
            list(c1.to_dense().parameters()) + list(r2.to_dense().parameters()),
            list(fc1.parameters()) + list(fc2.parameters()))) else float("inf")
    return {"errs": errs, "digests": digests}


def check_vocab(pg, case: dict) -> dict:
    """VocabParallelEmbedding, a column-parallel output layer and
    vocab_parallel_cross_entropy against nn.Embedding, nn.Linear and F.cross_entropy.
    ``case``: seed, vocab (a multiple of the group size), dim, lead (the ids' shape)."""
    gen = torch.Generator().manual_seed(case["seed"])
    vocab, dim, lead = case["vocab"], case["dim"], tuple(case["lead"])
    emb = _fill(nn.Embedding(vocab, dim), gen, scale=1.0)
    head = _fill(nn.Linear(dim, vocab), gen, scale=1.0)
    ids = torch.randint(0, vocab, lead, generator=gen)
    target = torch.randint(0, vocab, lead, generator=gen)
    if case["seed"] % 2:  # int32 ids work too
        ids, target = ids.int(), target.int()
    weights = torch.rand(lead, generator=gen)  # a weighted sum: every position's gradient

    pe = VocabParallelEmbedding.from_dense(emb, pg)
    ph = ColumnParallelLinear.from_dense(head, pg)
    h = pe(ids)
    logits = ph(h)
    logits.retain_grad()
    loss = vocab_parallel_cross_entropy(logits, target, pg)
    (loss * weights).sum().backward()

    hd = emb(ids)
    logits_d = head(hd)
    logits_d.retain_grad()
    loss_d = F.cross_entropy(logits_d.reshape(-1, vocab), target.reshape(-1).long(),
                             reduction="none").reshape(lead)
    (loss_d * weights).sum().backward()
    errs = {"emb.y": _err(h, hd), "loss": _err(loss, loss_d),
            "dlogits": _err(logits.grad, _block_of(logits_d.grad, -1, pg)),
            "emb.dw": _err(pe.weight.grad, _block_of(emb.weight.grad, 0, pg)),
            "head.dw": _err(ph.weight.grad, _block_of(head.weight.grad, 0, pg)),
            "head.db": _err(ph.bias.grad, _block_of(head.bias.grad, 0, pg)),
            "to_dense": 0.0 if torch.equal(pe.to_dense().weight, emb.weight) else float("inf")}
    return {"errs": errs, "digests": {"loss": _digest(loss), "emb.y": _digest(h)}}


def check_block(pg, case: dict) -> dict:
    """ParallelTransformerBlock, plain and sequence-parallel, against TransformerBlock.
    ``case``: seed, batch, seq, heads (a multiple of the group size), head_dim, ffn (a
    multiple of the group size), causal, sequence_parallel (then seq is a multiple too)."""
    gen = torch.Generator().manual_seed(case["seed"])
    hidden = case["heads"] * case["head_dim"]
    dense = TransformerBlock(hidden, case["heads"], case["ffn"], causal=case["causal"])
    _fill(dense, gen, scale=0.3)
    x = torch.randn(case["batch"], case["seq"], hidden, generator=gen)
    w_out = torch.randn(x.shape, generator=gen)
    sp = case["sequence_parallel"]

    block = ParallelTransformerBlock.from_dense(dense, pg, sequence_parallel=sp)
    xt, xd = x.clone().requires_grad_(), x.clone().requires_grad_()
    if sp:  # the residual stream in sequence blocks, gathered again for the comparison
        yt = gather_from_sequence(block(scatter_to_sequence(xt, pg)), pg, reduce_grad=False)
    else:
        yt = block(xt)
    yd = dense(xd)
    (yt * w_out).sum().backward()
    (yd * w_out).sum().backward()
    scale = max(t.abs().max().item() for t in
                [yd, xd.grad] + [p.grad for p in dense.parameters() if p.grad is not None])
    errs = {"y": _err(yt, yd, scale), "dx": _err(xt.grad, xd.grad, scale)}
    for name in ("ln1", "ln2"):
        for p in ("weight", "bias"):
            errs[f"{name}.d{p}"] = _err(getattr(getattr(block, name), p).grad,
                                        getattr(getattr(dense, name), p).grad, scale)
    for name, dim in (("q", 0), ("k", 0), ("v", 0), ("fc1", 0), ("proj", 1), ("fc2", 1)):
        ours, theirs = getattr(block, name), getattr(dense, name)
        errs[f"{name}.dw"] = _err(ours.weight.grad, _block_of(theirs.weight.grad, dim, pg),
                                  scale)
        errs[f"{name}.db"] = _err(ours.bias.grad, theirs.bias.grad if dim == 1
                                  else _block_of(theirs.bias.grad, 0, pg), scale)
    errs["to_dense"] = 0.0 if all(torch.equal(a, b) for a, b in zip(
        block.to_dense().parameters(), dense.parameters())) else float("inf")
    return {"errs": errs, "digests": {"y": _digest(yt), "dx": _digest(xt.grad),
                                      "ln1.dw": _digest(block.ln1.weight.grad)}}


CHECKS = {"linear": check_linear, "vocab": check_vocab, "block": check_block}


def _assert_ok(results: list, where: str = "") -> None:
    """Every error within tolerance on every rank; replicated values bitwise equal."""
    for rank, res in enumerate(results):
        bad = {k: v for k, v in res["errs"].items() if not v <= 1.0}
        assert not bad, f"{where} rank {rank}: beyond tolerance: {bad}"
    for key in results[0]["digests"]:
        assert len({r["digests"][key] for r in results}) == 1, \
            f"{where}: `{key}` differs between ranks"


# ------------------------------------------------------------------ fixed cases
def fixed_cases(n: int) -> list:
    """A few (check, case) pairs that suit a world of ``n``, run in every real-process job
    (with :func:`sweep_cases`)."""
    return [
        ("linear", dict(seed=1, lead=[3], d_in=5, hidden=2 * n, d_out=3, bias=True,
                        gather_output=False, input_is_parallel=True)),
        ("linear", dict(seed=2, lead=[2, 3], d_in=4, hidden=3 * n, d_out=2 * n, bias=False,
                        gather_output=True, input_is_parallel=False)),
        ("vocab", dict(seed=3, vocab=5 * n, dim=4, lead=[2, 3])),
        ("block", dict(seed=4, batch=2, seq=2 * n, heads=n, head_dim=4, ffn=3 * n,
                       causal=True, sequence_parallel=False)),
        ("block", dict(seed=5, batch=2, seq=2 * n, heads=2 * n, head_dim=2, ffn=2 * n,
                       causal=False, sequence_parallel=True)),
    ]


def sweep_cases(n: int, count: int = 4, seed: int = 0) -> list:
    """``count`` random cases of each check for a world of ``n`` (the properties' ranges),
    the same list in every process: the real-process jobs' share of the sweep."""
    import random
    rng = random.Random(seed * 101 + n)
    cases = []
    for i in range(count):
        cases.append(("linear", dict(
            seed=rng.randrange(2**31), lead=[rng.randint(0, 4)] * rng.randint(1, 2),
            d_in=rng.randint(1, 9), hidden=n * rng.randint(1, 4), d_out=rng.randint(1, 7),
            bias=rng.random() < 0.5, gather_output=rng.random() < 0.5,
            input_is_parallel=rng.random() < 0.5)))
        cases.append(("vocab", dict(seed=rng.randrange(2**31), vocab=n * rng.randint(1, 6),
                                    dim=rng.randint(1, 6), lead=[rng.randint(1, 4)] * 2)))
        cases.append(("block", dict(
            seed=rng.randrange(2**31), batch=rng.randint(1, 3), seq=n * rng.randint(1, 3),
            heads=n * rng.randint(1, 2), head_dim=rng.randint(1, 4),
            ffn=n * rng.randint(1, 4), causal=rng.random() < 0.5,
            sequence_parallel=i % 2 == 0)))
    return cases


def job_cases(n: int) -> list:
    return fixed_cases(n) + sweep_cases(n)


def _job_on(pg) -> list:
    return [CHECKS[name](pg, case) for name, case in job_cases(pg.size)]


def _spawned_job() -> dict:
    """The fixed cases on the world and, in a world of 4, on the sub-group {0, 1} (a group
    that is not the world, as a mesh dimension is)."""
    pg = collectives.init_process_group()
    try:
        out = {"world": _job_on(pg), "pair": None}
        if pg.size == 4 and pg.rank < 2:
            sub = pg.new_group([0, 1])
            try:
                out["pair"] = _job_on(sub)
            finally:
                sub.close()
        pg.barrier()
        return out
    finally:
        pg.close()


def _assert_job(results: list, where: str) -> None:
    n = len(results)
    for i, (name, case) in enumerate(job_cases(n)):
        _assert_ok([r["world"][i] for r in results], f"{where} n={n} {name} {case}")
    if n == 4:
        for i, (name, _) in enumerate(job_cases(2)):
            _assert_ok([r["pair"][i] for r in results[:2]], f"{where} pair {name}#{i}")


# ------------------------------------------------------------------ properties (threads)
from hypothesis import given, settings, strategies as st  # noqa: E402

PROPERTY = settings(max_examples=int(os.environ.get("TP_EXAMPLES", "25")), deadline=None)
worlds = st.integers(1, 4)
leads = st.lists(st.integers(0, 4), min_size=1, max_size=2)   # empty batches too


@PROPERTY
@given(n=worlds, seed=st.integers(0, 2**31), lead=leads, d_in=st.integers(1, 9),
       per_rank=st.integers(1, 4), d_out=st.integers(1, 7), bias=st.booleans(),
       gather_output=st.booleans(), input_is_parallel=st.booleans())
def test_linear_layers_equal_dense(n, seed, lead, d_in, per_rank, d_out, bias,
                                   gather_output, input_is_parallel):
    case = dict(seed=seed, lead=lead, d_in=d_in, hidden=per_rank * n, d_out=d_out, bias=bias,
                gather_output=gather_output, input_is_parallel=input_is_parallel)
    _assert_ok(run_threads(lambda pg: check_linear(pg, case), n, timeout=30), str(case))


@PROPERTY
@given(n=worlds, seed=st.integers(0, 2**31), per_rank=st.integers(1, 6),
       dim=st.integers(1, 6), lead=leads)
def test_vocab_parallel_embedding_and_loss_equal_dense(n, seed, per_rank, dim, lead):
    case = dict(seed=seed, vocab=per_rank * n, dim=dim, lead=lead)
    _assert_ok(run_threads(lambda pg: check_vocab(pg, case), n, timeout=30), str(case))


@PROPERTY
@given(n=worlds, seed=st.integers(0, 2**31), batch=st.integers(1, 3),
       seq_per_rank=st.integers(1, 3), heads_per_rank=st.integers(1, 2),
       head_dim=st.integers(1, 4), ffn_per_rank=st.integers(1, 4), causal=st.booleans(),
       sequence_parallel=st.booleans())
def test_transformer_block_equals_dense(n, seed, batch, seq_per_rank, heads_per_rank,
                                        head_dim, ffn_per_rank, causal, sequence_parallel):
    case = dict(seed=seed, batch=batch, seq=seq_per_rank * n, heads=heads_per_rank * n,
                head_dim=head_dim, ffn=ffn_per_rank * n, causal=causal,
                sequence_parallel=sequence_parallel)
    _assert_ok(run_threads(lambda pg: check_block(pg, case), n, timeout=30), str(case))


@PROPERTY
@given(n=worlds, seed=st.integers(0, 2**31), per_rank=st.integers(1, 3),
       middle=st.integers(1, 3), dim=st.sampled_from([0, 1, -1]))
def test_regions_forward_and_backward_closed_forms(n, seed, per_rank, middle, dim):
    """Each region's forward and backward, against what it must compute from every rank's
    input x_r and output gradient g_r (float64: the sums are exact enough to compare)."""
    full = (per_rank * n, middle * n, per_rank * n)     # every dim splits into n blocks

    def inputs(rank, shape):
        gen = torch.Generator().manual_seed(seed * 8 + rank)
        return (torch.randn(shape, generator=gen, dtype=torch.float64),
                torch.randn(shape, generator=gen, dtype=torch.float64))

    def block(t, rank, d):
        return t.chunk(n, d)[rank]

    def block_shape(d):
        shape = list(full)
        shape[d] //= n
        return tuple(shape)

    regions = {  # name: (function, shape of x, shape of y)
        "copy_to": (copy_to, full, full),
        "reduce_from": (reduce_from, full, full),
        "scatter_to": (scatter_to, full, block_shape(-1)),
        "gather_from": (gather_from, block_shape(-1), full),
        "scatter_to_sequence": (lambda x, g: scatter_to_sequence(x, g, dim), full,
                                block_shape(dim)),
        "gather_from_sequence": (lambda x, g: gather_from_sequence(x, g, dim),
                                 block_shape(dim), full),
        "reduce_scatter_to_sequence": (lambda x, g: reduce_scatter_to_sequence(x, g, dim),
                                       full, block_shape(dim)),
    }

    def body(pg):
        out = {}
        for name, (fn, x_shape, y_shape) in regions.items():
            x, g = inputs(pg.rank, x_shape)[0], inputs(pg.rank + n, y_shape)[0]
            x.requires_grad_()
            y = fn(x, pg)
            y.backward(g)
            out[name] = (y.detach(), x.grad)
        return out

    results = run_threads(body, n, timeout=30)
    xs = {name: [inputs(r, spec[1])[0] for r in range(n)] for name, spec in regions.items()}
    gs = {name: [inputs(r + n, spec[2])[0] for r in range(n)] for name, spec in regions.items()}
    cat = torch.cat
    for r, res in enumerate(results):
        expect = {
            "copy_to": (xs["copy_to"][r], sum(gs["copy_to"])),
            "reduce_from": (sum(xs["reduce_from"]), gs["reduce_from"][r]),
            "scatter_to": (block(xs["scatter_to"][r], r, -1), cat(gs["scatter_to"], -1)),
            "gather_from": (cat(xs["gather_from"], -1), block(gs["gather_from"][r], r, -1)),
            "scatter_to_sequence": (block(xs["scatter_to_sequence"][r], r, dim),
                                    cat(gs["scatter_to_sequence"], dim)),
            "gather_from_sequence": (cat(xs["gather_from_sequence"], dim),
                                     block(sum(gs["gather_from_sequence"]), r, dim)),
            "reduce_scatter_to_sequence": (block(sum(xs["reduce_scatter_to_sequence"]), r, dim),
                                           cat(gs["reduce_scatter_to_sequence"], dim)),
        }
        for name, (y, dx) in expect.items():
            got_y, got_dx = res[name]
            close = lambda a, b: a.shape == b.shape and torch.allclose(  # noqa: E731
                a, b, rtol=1e-12, atol=1e-12)
            assert close(got_y, y), (name, "forward", r)
            assert close(got_dx, dx), (name, "backward", r)


# ------------------------------------------------------------------ counting collectives
class _Counting:
    """A group that notes the name of every collective it forwards."""

    _COUNTED = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send", "recv",
                "isend", "irecv", "all_to_all", "gather", "scatter", "reduce")

    def __init__(self, pg) -> None:
        self._pg, self.calls = pg, []

    def __getattr__(self, name):
        attr = getattr(self._pg, name)
        if name not in self._COUNTED:
            return attr

        def counted(*args, **kwargs):
            self.calls.append(name)
            return attr(*args, **kwargs)
        return counted

    def take(self) -> list:
        calls, self.calls = self.calls, []
        return calls


def _count(pg) -> dict:
    gen = torch.Generator().manual_seed(0)
    group = _Counting(pg)
    out = {}

    fc1, fc2 = _fill(nn.Linear(6, 8), gen), _fill(nn.Linear(8, 3), gen)
    mlp = nn.Sequential(ColumnParallelLinear.from_dense(fc1, group), nn.ReLU(),
                        RowParallelLinear.from_dense(fc2, group))
    x = torch.randn(4, 6, generator=gen, requires_grad=True)
    y = mlp(x)
    out["mlp.forward"] = group.take()
    y.sum().backward()
    out["mlp.backward"] = group.take()
    mlp(torch.randn(4, 6, generator=gen)).sum().backward()   # data: no dL/dx to reduce
    out["mlp.data"] = group.take()

    emb = VocabParallelEmbedding.from_dense(_fill(nn.Embedding(8, 4), gen), group)
    head = ColumnParallelLinear.from_dense(_fill(nn.Linear(4, 8), gen), group)
    ids = torch.randint(0, 8, (2, 3), generator=gen)
    h = emb(ids)
    out["embedding.forward"] = group.take()
    logits = head(h.detach().requires_grad_())
    loss = vocab_parallel_cross_entropy(logits, ids, group).sum()
    out["loss.forward"] = group.take()
    loss.backward()
    out["loss.backward"] = group.take()

    dense = _fill(TransformerBlock(8, 4, 8), gen, scale=0.3)
    for sp in (False, True):
        block = ParallelTransformerBlock.from_dense(dense, group, sequence_parallel=sp)
        xb = torch.randn(2, 4 if not sp else 4 // pg.size, 8, generator=gen,
                         requires_grad=True)
        yb = block(xb)
        out[f"block.sp={sp}.forward"] = group.take()
        yb.sum().backward()
        out[f"block.sp={sp}.backward"] = group.take()
    return out


def test_collective_counts():
    """Column+row: one all_reduce forward, one backward (none where the input is data).
    The block: that per sub-block; sequence-parallel, all_gather + reduce_scatter per
    sub-block instead, and one all_reduce of the sequence-replicated parameters'
    gradients. Vocabulary-parallel: one all_reduce for the embedding, two for the loss
    (max; target logit and sum of exponentials together), none in the loss's backward."""
    for counts in run_threads(_count, 2, timeout=30):
        assert counts["mlp.forward"] == ["all_reduce"]
        assert counts["mlp.backward"] == ["all_reduce"]
        assert counts["mlp.data"] == ["all_reduce"]
        assert counts["embedding.forward"] == ["all_reduce"]
        assert counts["loss.forward"] == ["all_reduce", "all_reduce"]
        assert counts["loss.backward"] == ["all_reduce"]   # the head's copy_to, on dL/dh
        assert counts["block.sp=False.forward"] == ["all_reduce"] * 2
        assert counts["block.sp=False.backward"] == ["all_reduce"] * 2
        pair = ["all_gather", "reduce_scatter"]
        assert counts["block.sp=True.forward"] == pair * 2
        assert counts["block.sp=True.backward"] == ["all_gather", "reduce_scatter"] * 2 + \
            ["all_reduce"]
    # a world of one sends nothing at all
    counts = run_threads(_count, 1, timeout=30)[0]
    assert all(calls == [] for calls in counts.values()), counts


# ------------------------------------------------------------------ bad input
def test_bad_input_is_a_clear_error():
    def body(pg):
        msgs = {}
        for what, make in (
                ("column", lambda: ColumnParallelLinear(4, 5, pg, seed=0)),
                ("row", lambda: RowParallelLinear.from_dense(nn.Linear(7, 2), pg)),
                ("vocab", lambda: VocabParallelEmbedding(9, 2, pg, seed=0)),
                ("heads", lambda: ParallelTransformerBlock(6, 3, pg, 4, seed=0)),
                ("ffn", lambda: ParallelTransformerBlock(4, 2, pg, 5, seed=0))):
            with pytest.raises(ValueError) as info:
                make()
            msgs[what] = str(info.value)
        col = ColumnParallelLinear(4, 6, pg, seed=0)
        with pytest.raises(ValueError, match=r"last dim must be 4"):
            col(torch.ones(2, 5))
        row = RowParallelLinear(6, 2, pg, seed=0)
        with pytest.raises(ValueError, match=r"last dim must be 3"):
            row(torch.ones(2, 6))          # the whole input, where a block was expected
        with pytest.raises(ValueError, match=r"ids outside \[0, 8\)"):
            VocabParallelEmbedding(8, 2, pg, seed=0)(torch.tensor([8]))
        with pytest.raises(TypeError, match="int32 or int64"):
            VocabParallelEmbedding(8, 2, pg, seed=0)(torch.tensor([1.0]))
        with pytest.raises(ValueError, match="target"):
            vocab_parallel_cross_entropy(torch.zeros(3, 4), torch.zeros(2).long(), pg)
        with pytest.raises(ValueError, match="size of dim 1=3 is not divisible by the group"):
            scatter_to_sequence(torch.zeros(2, 3, 4), pg)
        sp = ParallelTransformerBlock(4, 2, pg, 4, seed=0, sequence_parallel=True)
        with pytest.raises(ValueError, match=r"shape \(batch, seq, 4\)"):
            sp(torch.zeros(2, 4))
        return msgs

    for rank, msgs in enumerate(run_threads(body, 2, timeout=30)):
        assert msgs["column"].startswith(f"[rank {rank}/2] ColumnParallelLinear: ")
        assert "out_features=5 is not divisible by the group size 2" in msgs["column"]
        assert "RowParallelLinear: in_features=7 is not divisible by the group size 2" \
            in msgs["row"]
        assert "VocabParallelEmbedding: num_embeddings=9 is not divisible" in msgs["vocab"]
        assert "ParallelTransformerBlock: num_heads=3 is not divisible" in msgs["heads"]
        assert "ParallelTransformerBlock: ffn_hidden=5 is not divisible" in msgs["ffn"]

    def bf16(pg):  # 16-bit logits: float32 inside, the loss float32, the gradient bf16
        g = torch.Generator().manual_seed(0)
        full, y = torch.randn(3, 8, generator=g) * 5, torch.randint(0, 8, (3,), generator=g)
        logits = _block_of(full, -1, pg).bfloat16().requires_grad_()
        loss = vocab_parallel_cross_entropy(logits, y, pg)
        loss.sum().backward()
        ref = F.cross_entropy(full.bfloat16().float(), y, reduction="none")
        return loss.dtype, logits.grad.dtype, (loss - ref).abs().max().item()

    for dtype, grad_dtype, err in run_threads(bf16, 2):
        assert dtype == torch.float32 and grad_dtype == torch.bfloat16 and err < 1e-5

    with pytest.raises(TypeError, match="ColumnParallelLinear: argument `group`"):
        ColumnParallelLinear(4, 4, object())
    with pytest.raises(TypeError, match="from_dense: argument `linear` must be a torch.nn.Li"):
        RowParallelLinear.from_dense(nn.Conv1d(2, 2, 1), None)
    with pytest.raises(TypeError, match="copy_to: argument `x`"):
        copy_to([1.0], None)


def test_constructor_from_sizes_is_one_dense_layer():
    """Built from sizes, the ranks hold the blocks of one dense nn.Linear (rank 0's seed,
    broadcast), not the same block twice; a given seed gives the same layer in any world."""
    def body(pg):
        col, row = ColumnParallelLinear(3, 4, pg), RowParallelLinear(4, 3, pg, bias=False)
        seeded = ColumnParallelLinear(3, 4, pg, seed=11).to_dense()
        block = ParallelTransformerBlock(4, 2, pg, 4, seed=5).to_dense()
        return (col.weight.detach().clone(), col.to_dense().weight.detach(),
                row.to_dense().weight.detach(), row.bias, seeded.weight.detach(),
                torch.cat([p.detach().reshape(-1) for p in block.parameters()]))

    one = run_threads(body, 1)[0]
    (w0, d0, r0, b0, s0, k0), (w1, d1, r1, b1, s1, k1) = run_threads(body, 2)
    assert torch.equal(k0, k1) and torch.equal(k0, one[5])   # the same block in any world
    assert torch.equal(d0, d1) and torch.equal(r0, r1) and b0 is None and b1 is None
    assert torch.equal(torch.cat([w0, w1]), d0) and not torch.equal(w0, w1)
    assert torch.equal(s0, s1) and torch.equal(s0, one[4])
    # the dense initialisation: nn.Linear's bounds, 1/sqrt(in_features)
    assert d0.abs().max() <= 3 ** -0.5


# ------------------------------------------------------------------ real processes
def _spawnable_backends() -> list:
    return ["shm"] + [b for b in collectives.available_backends()
                      if b not in ("shm", "mpi", "nccl", "torch")]


@pytest.mark.parametrize("backend, nproc", [("shm", 4)] + [(b, 2) for b in
                                                          _spawnable_backends()[1:]])
def test_spawned(backend, nproc):
    """The fixed cases in real processes, one job per backend; shm's world of 4 also runs
    them on the sub-group {0, 1}."""
    if backend != "shm":
        try:
            collectives.get_backend(backend)
        except ImportError as exc:
            pytest.skip(f"backend {backend} does not import: {exc}")
    results = collectives.spawn(_spawned_job, nproc, backend=backend, timeout=60,
                                join_timeout=120)
    _assert_job(results, backend)


def _env() -> dict:
    return job_env()


def _start(command: list) -> subprocess.Popen:
    return subprocess.Popen(command, cwd=ROOT, env=_env(), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen, timeout: float) -> tuple:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    assert proc.returncode == 0, f"{proc.args}: exit {proc.returncode}\n{err[-3000:]}"
    return out, err


def _run(command: list, timeout: float) -> subprocess.CompletedProcess:
    out, err = _finish(_start(command), timeout)
    return subprocess.CompletedProcess(command, 0, out, err)


needs_mpi = pytest.mark.skipif(
    MPIEXEC is None or importlib.util.find_spec("mpi4py") is None,
    reason="needs mpiexec and mpi4py (pip install mpi4py mpich)")


@needs_mpi
def test_under_mpiexec(tmp_path):
    """The job's cases on the mpi backend: this file run by ``mpiexec -n 2`` (the example
    test runs 4 ranks under mpiexec), each rank writing its results to a file (mpiexec
    may interleave long lines of output)."""
    _run([MPIEXEC, "-n", "2", sys.executable, __file__, str(tmp_path)], timeout=120)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert {d["backend"] for d in reports} == {"mpi"}
    _assert_job([d["result"] for d in reports], "mpi")


# ------------------------------------------------------------------ the example
_EPOCH_LINE = re.compile(r"epoch (\d+)/(\d+) loss ([0-9.]+)")


def _summary(out: str, err: str) -> tuple:
    """The summary line and the per-epoch losses rank 0 printed."""
    summary = json.loads(out.strip().splitlines()[-1])
    assert list(summary) == ["example", "backend", "world_size", "epochs", "wall_s", "total_s",
                             "samples_per_s", "final_loss", "final_acc"]
    losses = [float(m.group(3)) for m in _EPOCH_LINE.finditer(err)]
    return summary, losses


def _example(command: list, timeout: float) -> tuple:
    proc = _run(command, timeout)
    return _summary(proc.stdout, proc.stderr)


def _dense_losses(epochs: int) -> list:
    from examples.common.cli import parse_args
    from examples.tp import dense_mlp, train
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank of the example: more only contend on 2 cores
    try:
        return train(dense_mlp(0), parse_args("tp", [], epochs=epochs))
    finally:
        torch.set_num_threads(threads)


def test_example_follows_the_dense_model(tmp_path):
    """examples/tp.py over 2 shm ranks for its default epochs: the loss curve of the dense
    model from the same initial weights and batches (the sums are taken in another order,
    so they drift apart slowly), and at least 85% accuracy."""
    trace = tmp_path / "tp.json"
    proc = _start([sys.executable, "examples/tp.py", "--trace", str(trace)])
    dense = _dense_losses(3)            # here, while the example runs
    summary, losses = _summary(*_finish(proc, timeout=180))
    assert summary["example"] == "tp" and summary["backend"] == "shm"
    assert summary["world_size"] == 2 and summary["final_acc"] >= 0.85, summary
    assert len(losses) == len(dense) == summary["epochs"] == 3
    assert abs(losses[0] - dense[0]) <= 1e-4 * dense[0], (losses, dense)
    for ours, theirs in zip(losses, dense):
        assert abs(ours - theirs) <= 0.05 * theirs, (losses, dense)
    assert losses[-1] < 0.5 * losses[0]
    events = json.loads(trace.read_text())["traceEvents"]
    for rank in (0, 1):
        names = {e["name"] for e in events if e["pid"] == rank}
        assert {"forward", "backward", "step", "all_reduce"} <= names


@needs_mpi
def test_example_under_mpiexec():
    summary, losses = _example([MPIEXEC, "-n", "4", sys.executable, "examples/tp.py",
                                "--epochs", "1"], timeout=120)
    assert summary["backend"] == "mpi" and summary["world_size"] == 4
    assert summary["epochs"] == 1 and len(losses) == 1 and summary["final_acc"] > 0.8


@pytest.mark.slow
@needs_mpi
def test_example_under_mpiexec_default_epochs():
    summary, _ = _example([MPIEXEC, "-n", "4", sys.executable, "examples/tp.py"], timeout=300)
    assert summary["world_size"] == 4 and summary["final_acc"] >= 0.85


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("torchrun") is None, reason="needs torchrun")
def test_example_under_torchrun_gloo():
    summary, _ = _example([shutil.which("torchrun"), "--standalone", "--nproc-per-node", "2",
                           "examples/tp.py", "--backend", "gloo"], timeout=300)
    assert summary["backend"] == "gloo" and summary["world_size"] == 2
    assert summary["final_acc"] >= 0.85


if __name__ == "__main__":  # one rank of test_under_mpiexec's job: python test_tp.py DIR
    torch.set_num_threads(1)
    _pg = collectives.init_process_group()
    try:
        _report = {"backend": _pg.backend, "result": {"world": _job_on(_pg), "pair": None}}
        Path(sys.argv[1], f"rank{_pg.rank}.json").write_text(json.dumps(_report))
        _pg.barrier()
    finally:
        _pg.close()
