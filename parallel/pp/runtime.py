"""One runtime for every schedule: build the schedule, check it, lower it, run this
rank's program.

    stage = PipelineStage(my_layers, pg, stage_index=pg.rank, num_stages=pg.size)
    sched = Schedule1F1B(stage, n_microbatches=4, loss_fn=F.cross_entropy)
    losses = sched.step(x if stage.is_first else None, target=y if stage.is_last else None)
    opt.step()                      # .grad holds the gradient of mean(losses)

``step`` splits ``x`` (on the rank of stage 0) and ``target`` (on the rank of the last
stage) along dim 0 into equal micro-batches and returns the raw micro-batch losses on
the last stage's rank, ``None`` elsewhere. Backward starts from ``loss / M``, so the
gradients accumulated in the stages' ``.grad`` are those of the mean loss, as the unsplit
model's would be on the whole batch.

Sends are ``isend`` (waited for at the end of the step), receives ``irecv`` posted one
compute action before their consumer, which waits: neighbours sending to each other at
the same time cannot deadlock, and a message travels while the rank computes.
Activation shapes and dtypes are not declared: the first step sends, before each stage
boundary's first activation, a small header (dtype and shape); later steps reuse it, so
every step must use the same micro-batch shape.

Data parallelism across pipelines (a device mesh's ``dp`` dimension): a stage module that
has ``no_sync()`` (``parallel.DDP``, ``parallel.FSDP``) runs every micro-batch's forward
but the last inside it, so the gradients accumulate locally over the step and are averaged
across replicas once, in the last micro-batch's backward (which every non-split schedule
runs last on each stage; the constructor checks). Zero-bubble schedules, whose weight
gradients come in separate W passes, refuse such modules.
"""

from __future__ import annotations

import time
from typing import Callable, Optional, Sequence

import torch

from .actions import B, F, RECV_B, RECV_F, SEND_B, SEND_F, W, Action
from .checker import check_schedule
from .lowering import channel
from .schedules import gpipe, interleaved_1f1b, one_f_one_b, zb_h1
from .stage import PipelineStage

__all__ = ["PipelineSchedule", "Schedule1F1B", "ScheduleGPipe", "ScheduleInterleaved1F1B",
           "ScheduleZeroBubble"]

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
           torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool]
_MAX_DIMS = 8
_HEADER_TAG_OFFSET = 15000   # header tags: message tag + this (still below 32767)


class PipelineSchedule:
    """The runtime shared by every schedule: subclasses only say which generator.

    Messages use tags from 1000 up on the stages' group (:mod:`parallel.pp.lowering`).
    """

    #: Whether B is the input gradient only and W the weight gradient (zero bubble).
    split_backward = False

    def __init__(self, stages: Sequence[PipelineStage], n_microbatches: int,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        name = type(self).__name__
        if not stages or not all(isinstance(s, PipelineStage) for s in stages):
            raise TypeError(f"{name}: expected PipelineStage objects, got {stages!r}")
        group = stages[0].group
        self._where = f"[rank {group.rank}/{group.size}] {name}"
        if isinstance(n_microbatches, bool) or not isinstance(n_microbatches, int) \
                or n_microbatches < 1:
            raise ValueError(f"{self._where}: n_microbatches must be an int >= 1, got "
                             f"{n_microbatches!r}")
        if not callable(loss_fn):
            raise TypeError(f"{self._where}: loss_fn must be callable, got {loss_fn!r}")
        num_stages = stages[0].num_stages
        expected = list(range(group.rank, num_stages, group.size))
        if [s.stage_index for s in stages] != expected or any(
                s.group is not group or s.num_stages != num_stages for s in stages):
            raise ValueError(f"{self._where}: this rank must pass its stages {expected} of "
                             f"{num_stages}, in order, on one group; got "
                             f"{[s.stage_index for s in stages]}")
        self.group, self.stages = group, {s.stage_index: s for s in stages}
        self.num_stages, self.n_microbatches, self.loss_fn = num_stages, n_microbatches, loss_fn
        #: The whole schedule (every rank's compute, bubbles as None), checked.
        self.schedule = self._generate(group.size, n_microbatches, num_stages)
        self._split = self.split_backward
        self.program = check_schedule(self.schedule, num_stages, n_microbatches,
                                      split_backward=self._split)[group.rank]
        self._check_gradient_sync()
        self._meta: dict[int, tuple] = {}          # stage -> (dtype, shape) of its input
        self._meta_sent: set[int] = set()          # stages whose output header went out
        #: The last step's compute actions on this rank: ``(action, start_s, end_s)``.
        self.timeline: list[tuple[Action, float, float]] = []
        #: The most micro-batches whose activations this rank held at once, last step.
        self.peak_activations = 0

    def _generate(self, num_ranks: int, n_microbatches: int, num_stages: int):
        raise NotImplementedError

    def _check_gradient_sync(self) -> None:
        """Note the stages whose modules have ``no_sync()`` (``self._syncing``): they
        synchronise in micro-batch M-1's backward, so it must be the last backward of their
        stage (see the module docstring)."""
        syncing = [s for s, st in self.stages.items() if hasattr(st.module, "no_sync")]
        self._syncing = frozenset(syncing)
        if syncing and self._split:
            raise ValueError(f"{self._where}: stage {syncing[0]}'s module "
                             f"({type(self.stages[syncing[0]].module).__name__}) synchronises "
                             f"gradients (has no_sync()); a zero-bubble schedule computes "
                             f"them in separate W passes, which DDP/FSDP cannot follow: use "
                             f"ScheduleGPipe or Schedule1F1B")
        for s in syncing:
            order = [a.microbatch for a in self.program if a.kind == B and a.stage == s]
            if order and order[-1] != self.n_microbatches - 1:
                raise ValueError(f"{self._where}: stage {s}'s last backward is micro-batch "
                                 f"{order[-1]}, not {self.n_microbatches - 1}: its module's "
                                 f"gradient sync (no_sync) would not see every micro-batch")

    # ------------------------------------------------------------------------- step
    def step(self, x: Optional[torch.Tensor] = None, *,
             target: Optional[torch.Tensor] = None) -> Optional[list[torch.Tensor]]:
        """Run one pipelined forward and backward over the batch; see the module docstring.

        Both ranks of a 2-stage pipeline: ``losses = sched.step(x if rank == 0 else None,
        target=y if rank == 1 else None)``; rank 1 gets M losses, rank 0 ``None``.
        """
        M, last = self.n_microbatches, self.num_stages - 1
        self._inputs = self._split_batch(x, "x") if 0 in self.stages else None
        self._targets = self._split_batch(target, "target") if last in self.stages else None
        self._losses: list[Optional[torch.Tensor]] = [None] * M
        self._posted: dict[Action, tuple] = {}    # receive -> (buffer, Work)
        self._deferred: list[Action] = []         # receives whose shape is not known yet
        self._handed: dict[tuple, torch.Tensor] = {}   # hand-offs between a rank's stages
        self._to_send: dict[Action, torch.Tensor] = {}  # SEND_F / SEND_B -> tensor
        sends: list[tuple] = []
        self.timeline, self.peak_activations = [], 0
        for action in self.program:
            kind = action.kind
            if kind in (RECV_F, RECV_B):
                self._deferred.append(action)
                self._flush()
            elif kind in (SEND_F, SEND_B):
                header = kind == SEND_F and action.stage not in self._meta_sent
                sends += self._send(action, self._to_send.pop(action), header=header)
                if header:
                    self._meta_sent.add(action.stage)
            else:
                run = {F: self._forward, B: self._backward, W: self._weight}[kind]
                start = run(action)   # the time the inputs were there and compute began
                self.timeline.append((action, start, time.time()))
                self.peak_activations = max(self.peak_activations,
                                            sum(st.held for st in self.stages.values()))
        for work, _ in sends:
            work.wait()
        return list(self._losses) if last in self.stages else None

    def _forward(self, action: Action) -> float:
        s, m = action.stage, action.microbatch
        if s == 0:
            inp = self._inputs[m]
        elif (s - 1) in self.stages:
            inp = self._handed.pop((s, m, F))
        else:
            inp = self._wait_recv(Action(s, RECV_F, m))
        start = time.time()
        stage = self.stages[s]
        if m < self.n_microbatches - 1 and s in self._syncing:
            with stage.module.no_sync():      # averaged once, in micro-batch M-1's backward
                out = stage.forward(m, inp)
        else:
            out = stage.forward(m, inp)
        if s == self.num_stages - 1:
            loss = self.loss_fn(out, self._targets[m])
            self._losses[m] = loss.detach()
            self.stages[s].set_loss(m, loss / self.n_microbatches)
        elif (s + 1) in self.stages:
            self._handed[(s + 1, m, F)] = out.detach()
        else:
            self._to_send[Action(s, SEND_F, m)] = out.detach()
        self._meta.setdefault(s + 1, (out.dtype, tuple(out.shape)))
        return start

    def _backward(self, action: Action) -> float:
        s, m = action.stage, action.microbatch
        if s == self.num_stages - 1:
            grad_out = None
        elif (s + 1) in self.stages:
            grad_out = self._handed.pop((s, m, B))
        else:
            grad_out = self._wait_recv(Action(s, RECV_B, m))
        start = time.time()
        stage = self.stages[s]
        grad_in = (stage.backward_input(m, grad_out) if self._split
                   else stage.backward(m, grad_out))
        if s > 0 and (s - 1) in self.stages:
            self._handed[(s - 1, m, B)] = grad_in
        elif s > 0:
            self._to_send[Action(s, SEND_B, m)] = grad_in
        return start

    def _weight(self, action: Action) -> float:
        start = time.time()
        self.stages[action.stage].backward_weight(action.microbatch)
        return start

    def _split_batch(self, batch: Optional[torch.Tensor], name: str) -> list[torch.Tensor]:
        M = self.n_microbatches
        if not isinstance(batch, torch.Tensor):
            raise ValueError(f"{self._where}: step: `{name}` must be the whole batch (a "
                             f"tensor) on the rank holding stage "
                             f"{0 if name == 'x' else self.num_stages - 1}, got "
                             f"{type(batch).__name__}")
        if batch.dim() == 0 or batch.shape[0] % M:
            raise ValueError(f"{self._where}: step: `{name}` has "
                             f"{batch.shape[0] if batch.dim() else 0} rows along dim 0, not "
                             f"a multiple of n_microbatches={M}")
        chunks = batch.split(batch.shape[0] // M)
        first = self._meta.get(0)
        if name == "x":
            meta = (chunks[0].dtype, tuple(chunks[0].shape))
            if first is not None and first != meta:
                raise ValueError(f"{self._where}: step: micro-batches of `x` are {meta}, the "
                                 f"first step's were {first}; the pipeline's shapes are "
                                 f"fixed by its first step")
            self._meta[0] = meta
        return list(chunks)

    # ---------------------------------------------------------------- communication
    def _send(self, action: Action, tensor: torch.Tensor, *, header: bool) -> list[tuple]:
        """Start the send (and, first, the header); ``(Work, buffer)`` pairs: the
        buffers stay referenced until the Works are waited for."""
        _, dst, tag = channel(action, self.group.size)
        out = []
        if header:
            meta = _encode_meta(tensor, self._where)
            out.append((self.group.isend(meta, dst, tag + _HEADER_TAG_OFFSET), meta))
        tensor = tensor.contiguous()
        out.append((self.group.isend(tensor, dst, tag), tensor))
        return out

    def _flush(self) -> None:
        """Post, in order, the deferred receives whose shape is known. A channel's receives
        must be posted in program order (messages match in posting order), so one whose
        shape is unknown holds back the later ones of its channel."""
        held, still = set(), []
        for action in self._deferred:
            ch = channel(action, self.group.size)
            meta = self._recv_meta(action)
            if ch in held or meta is None:
                held.add(ch)
                still.append(action)
                continue
            buffer = torch.empty(meta[1], dtype=meta[0])
            self._posted[action] = buffer, self.group.irecv(buffer, ch[0], ch[2])
        self._deferred = still

    def _recv_meta(self, action: Action) -> Optional[tuple]:
        # RECV_F of stage s: the input of s; RECV_B of s: the output of s (input of s+1).
        return self._meta.get(action.stage if action.kind == RECV_F else action.stage + 1)

    def _wait_recv(self, action: Action) -> torch.Tensor:
        """Wait for the receive ``action`` (first step: its header first) and return it."""
        if action not in self._posted:
            if self._recv_meta(action) is None:   # only RECV_F: B's shape is F's output
                src, _, tag = channel(action, self.group.size)
                header = torch.empty(2 + _MAX_DIMS, dtype=torch.int64)
                self.group.recv(header, src, tag + _HEADER_TAG_OFFSET)
                self._meta[action.stage] = _decode_meta(header)
            self._flush()
        buffer, work = self._posted.pop(action)
        work.wait()
        return buffer


def _encode_meta(t: torch.Tensor, where: str) -> torch.Tensor:
    if t.dim() > _MAX_DIMS or t.dtype not in _DTYPES:
        raise TypeError(f"{where}: a stage output of shape {tuple(t.shape)} and dtype "
                        f"{t.dtype} cannot be sent (at most {_MAX_DIMS} dims, dtypes "
                        f"{_DTYPES})")
    header = torch.zeros(2 + _MAX_DIMS, dtype=torch.int64)
    header[0], header[1] = _DTYPES.index(t.dtype), t.dim()
    header[2:2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    return header


def _decode_meta(header: torch.Tensor) -> tuple:
    ndim = int(header[1])
    return _DTYPES[int(header[0])], tuple(int(d) for d in header[2:2 + ndim])


class _SingleStage(PipelineSchedule):
    def __init__(self, stage: PipelineStage, n_microbatches: int, loss_fn: Callable) -> None:
        if not isinstance(stage, PipelineStage):
            raise TypeError(f"{type(self).__name__}: `stage` must be a PipelineStage, got "
                            f"{type(stage).__name__} (ScheduleInterleaved1F1B takes a list)")
        if stage.num_stages != stage.group.size:
            raise ValueError(f"[rank {stage.group.rank}/{stage.group.size}] "
                             f"{type(self).__name__}: one stage per rank, so num_stages must "
                             f"be {stage.group.size}, got {stage.num_stages}; use "
                             f"ScheduleInterleaved1F1B for several stages per rank")
        super().__init__([stage], n_microbatches, loss_fn)


class ScheduleGPipe(_SingleStage):
    """All forwards, then all backwards (:func:`parallel.pp.schedules.gpipe`)."""

    def _generate(self, num_ranks, n_microbatches, num_stages):
        return gpipe(num_ranks, n_microbatches)


class Schedule1F1B(_SingleStage):
    """One forward, one backward (:func:`parallel.pp.schedules.one_f_one_b`): at most P
    micro-batches' activations per rank, where GPipe holds M."""

    def _generate(self, num_ranks, n_microbatches, num_stages):
        return one_f_one_b(num_ranks, n_microbatches)


class ScheduleZeroBubble(_SingleStage):
    """ZB-H1 (:func:`parallel.pp.schedules.zb_h1`): backward split into input gradient B
    and weight gradient W, the W passes filling the bubbles."""

    split_backward = True

    def _generate(self, num_ranks, n_microbatches, num_stages):
        return zb_h1(num_ranks, n_microbatches)


class ScheduleInterleaved1F1B(PipelineSchedule):
    """Interleaved 1F1B over this rank's ``stages`` (r, r+P, ..., ``num_stages = P*V``),
    :func:`parallel.pp.schedules.interleaved_1f1b`. ``n_microbatches`` must be a multiple
    of P (a ``ValueError`` says which values are allowed)."""

    def __init__(self, stages: Sequence[PipelineStage], n_microbatches: int,
                 loss_fn: Callable) -> None:
        if isinstance(stages, PipelineStage):
            stages = [stages]
        super().__init__(list(stages), n_microbatches, loss_fn)

    def _generate(self, num_ranks, n_microbatches, num_stages):
        try:
            return interleaved_1f1b(num_ranks, n_microbatches, num_stages // num_ranks)
        except ValueError as exc:
            raise ValueError(f"{self._where}: {exc}") from None
