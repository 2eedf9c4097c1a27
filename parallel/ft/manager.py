"""``Manager``: one replica's side of fault-tolerant training, step by step (modelled on
torchft's Manager; see :mod:`parallel.ft` for the whole picture).

Per step::

    manager.start_step()           # quorum; re-form the group if it changed; heal
    ...forward, backward...
    manager.all_reduce(grads)      # SUM over the step's participants, or a no-op
    if manager.should_commit():    # every participant's all_reduce succeeded
        optimizer.step()

A failure inside a collective (a dead, stopped or leaving peer: ``CollectiveError``)
never escapes to the training loop: the manager records it, aborts its group (so the
peers' calls over this replica fail at once instead of waiting for their timeout),
turns the rest of the step's collectives into no-ops and votes against the commit. The
coordinator's decision is the same for every participant, so a step is applied by all
of them or by none; the next ``start_step`` re-forms the group without the dead.

Two replicas (``RANK`` 0 and 1), each::

    manager = Manager(state_dict=lambda: {"model": model.state_dict(),
                                          "optim": opt.state_dict()},
                      load_state_dict=lambda s: (model.load_state_dict(s["model"]),
                                                 opt.load_state_dict(s["optim"])),
                      coordinator="127.0.0.1:29400", timeout=10.0)
"""

from __future__ import annotations

import hashlib
import os
import time
from typing import Any, Callable, Optional

import numpy as np

import collectives
from collectives import CollectiveError, ProcessGroup, ReduceOp, settings

from .client import CoordinatorClient
from .healing import receive_state, send_state

__all__ = ["Manager"]


class Manager:
    """Quorum, group, healing and commit for one replica (see the module docstring).

    ``state_dict()`` returns the training state a healing replica receives (tensors
    travel bit for bit) and ``load_state_dict(state)`` installs it; ``coordinator``
    (``host:port``, default ``COLLECTIVES_FT_COORDINATOR``) decides quorums and commits;
    ``backend`` is the transport of the groups (default: as ``init_process_group``);
    ``timeout`` bounds every collective wait, so a stopped peer costs at most that
    long; ``replica_id`` names this process at the coordinator (default ``RANK:pid``, so
    a replacement with the same ``RANK`` is a new replica); ``on_phase(phase, manager)``
    hears ``"heal_send"`` and ``"heal_receive"`` before healing moves bytes (tests
    inject faults there).
    """

    def __init__(self, *, state_dict: Callable[[], Any],
                 load_state_dict: Callable[[Any], None],
                 coordinator: Optional[str] = None, backend: Optional[str] = None,
                 timeout: float = 10.0, replica_id: Optional[str] = None,
                 heartbeat_interval: float = 0.2, request_timeout: float = 300.0,
                 on_phase: Optional[Callable[[Any, "Manager"], None]] = None) -> None:
        address = coordinator or settings.FT_COORDINATOR.get()
        if not address:
            raise ValueError(f"Manager: no coordinator: pass `coordinator` ('host:port') or "
                             f"set {settings.FT_COORDINATOR.name}")
        if not callable(state_dict) or not callable(load_state_dict):
            raise TypeError("Manager: `state_dict` and `load_state_dict` must be callables")
        if not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"Manager: argument `timeout` must be a positive number of "
                             f"seconds, got {timeout!r}")
        self._state_dict, self._load_state_dict = state_dict, load_state_dict
        self._on_phase = on_phase or (lambda phase, manager: None)
        self.backend, self.timeout = backend, float(timeout)
        self.replica_id = replica_id or f"{os.environ.get('RANK', '0')}:{os.getpid()}"
        self.client = CoordinatorClient(address, self.replica_id, timeout=request_timeout)
        self.client.start_heartbeats(heartbeat_interval)
        #: The group of the current quorum (None until the first step, and after a
        #: failure until the next quorum).
        self.group: Optional[ProcessGroup] = None
        self.quorum_id = 0
        #: Steps committed so far (the same on every participant, healing included).
        self.step = 0
        self.rank, self.size = 0, 1
        #: Whether this replica never held the training state (a new process).
        self.fresh = True
        self.done = False
        self._error: Optional[BaseException] = None
        self._broken = False
        self._step_started = 0.0
        #: Counters for reports: failed steps seen here, re-formed groups, heals received
        #: and sent, steps committed and skipped.
        self.stats = {"errors": 0, "reforms": 0, "healed": 0, "heals_sent": 0,
                      "committed": 0, "skipped": 0}

    # ------------------------------------------------------------------- a step
    def start_step(self) -> bool:
        """Learn this step's quorum, re-form the group when it changed, heal when this
        replica is new or behind (or send the state when it is the source). Returns
        False when the job is over (another replica trained to the end)."""
        self._error = None
        self._step_started = time.monotonic()
        q = self.client.quorum(step=self.step, quorum_id=self.quorum_id, broken=self._broken,
                               fresh=self.fresh)
        self._broken = False
        if q.get("done"):
            self.done = True
            return False
        self.rank, self.size = int(q["rank"]), int(q["size"])
        if self.group is None or int(q["quorum_id"]) != self.quorum_id:
            self._form(int(q["quorum_id"]))
        if self._error is None:
            self._heal(q)
        return True

    def _form(self, quorum_id: int) -> None:
        old, self.group = self.group, None
        try:
            if old is not None and quorum_id > old.generation:
                self.group = old.reform(self.rank, self.size, quorum_id)
            else:
                if old is not None:
                    old.abort("left behind by a newer quorum")
                self.group = collectives.join_group(self.backend, rank=self.rank,
                                                    world_size=self.size,
                                                    generation=quorum_id,
                                                    timeout=self.timeout)
            self.quorum_id = quorum_id
            self.stats["reforms"] += 1
        except (CollectiveError, TimeoutError, OSError) as exc:
            self._fail(exc)

    def _heal(self, q: dict) -> None:
        source, healers = q["source"], q["healers"]
        if source is None:
            self.fresh = False       # nobody holds state yet: all start alike
            return
        try:
            if self.rank == source:
                state = {"step": self.step, "user": self._state_dict()}
                self._on_phase("heal_send", self)
                for dst in healers:
                    send_state(self.group, dst, state)
                    self.stats["heals_sent"] += 1
            elif self.rank in healers:
                self._on_phase("heal_receive", self)
                state = receive_state(self.group, source)
                self._load_state_dict(state["user"])
                self.step = int(state["step"])
                self.fresh = False
                self.stats["healed"] += 1
        except CollectiveError as exc:
            self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        """Record the step's first failure and leave the group, so the peers' calls
        over this replica end now rather than at their timeout."""
        if self._error is None:
            self._error = exc
            self.stats["errors"] += 1
        if self.group is not None:
            self.group.abort(f"parallel.ft: {type(exc).__name__} in this step")
            self.group = None

    @property
    def errored(self) -> Optional[BaseException]:
        """The failure of this step so far, or None."""
        return self._error

    def all_reduce(self, array: Any, op: ReduceOp = ReduceOp.SUM) -> bool:
        """All-reduce ``array`` in place over the step's participants; a no-op once the
        step failed. Returns whether it ran and succeeded (a failure is recorded, never
        raised; bad arguments still raise)."""
        if self._error is not None or self.group is None:
            return False
        try:
            self.group.all_reduce(array, op)
            return True
        except CollectiveError as exc:
            self._fail(exc)
            return False

    def should_commit(self) -> bool:
        """The coordinator's decision for this step, the same on every participant: True
        when every participant's collectives succeeded (then the step counts), False
        otherwise (nobody applies it; the next step re-forms the group)."""
        ok = self._error is None and self.group is not None and not self.fresh
        decision = self.client.commit(quorum_id=self.quorum_id, step=self.step, ok=ok)
        if decision:
            self.step += 1
            self.stats["committed"] += 1
        else:
            self.stats["skipped"] += 1
            self._broken = True
        return decision

    def close(self, *, finished: bool = False) -> None:
        """Leave: tell the coordinator (``finished``: this replica trained to the end),
        stop the heartbeats and close the group. Idempotent."""
        self.client.leave(finished)
        self.client.close()
        group, self.group = self.group, None
        if group is not None:
            group.abort("parallel.ft: the replica left")

    @staticmethod
    def digest(arrays: Any) -> str:
        """A SHA-256 of ``arrays``' bytes (numpy arrays or tensors), for checking that
        replicas are bitwise equal."""
        h = hashlib.sha256()
        for a in arrays:
            h.update(np.ascontiguousarray(a.detach().cpu().numpy() if hasattr(a, "detach")
                                          else a).tobytes())
        return h.hexdigest()
