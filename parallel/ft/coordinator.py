"""The coordinator of a fault-tolerant job: it decides each step's participants (the
quorum) and whether each step is committed, and it must outlive any rank.

Where it lives, and why: in the launcher (``examples/elastic.py`` starts one with
:meth:`Coordinator.start` before it starts the ranks), on a thread, reached over TCP.
The launcher is the one process of the job that is not a rank: it already has to
survive every rank's death (it respawns replacements and prints the summary), so
putting the coordinator there adds no process that could die on its own; TCP keeps it
reachable from ranks on other hosts, and a job without such a launcher runs it alone
with ``python -m parallel.ft --port P --min-replicas N``. Its state is a
few ids and step numbers, so a restart of the launcher is a restart of the job.

What it answers (one JSON line each way, :mod:`parallel.ft.wire`):

- ``heartbeat``: replica ``id`` is alive. A replica silent for ``heartbeat_timeout``
  seconds (dead, or stopped with SIGSTOP) is left out of the next quorum and fails the
  commit it owes; heartbeats again and it is asked into the next round.
- ``quorum``: wait for this round's quorum (:mod:`parallel.ft.quorum`). A round closes
  when every live replica asked (at least ``min_replicas``; the first round waits for
  ``first_quorum``), or ``join_timeout`` after its first ask with ``min_replicas``.
- ``commit``: this member's all_reduce succeeded or not; the answer is the step's one
  decision: True only when every member of the step's quorum said it succeeded. A
  failure, or a member that stops heartbeating before it votes, decides False at once.
  Every member, early or late, gets the same decision, so a step is applied by all of
  its participants or by none.
- ``leave``: a replica ends (``finished``: it trained to the end; later quorums answer
  ``done`` so a replacement started too late does not train alone).

Two ranks and the launcher::

    coordinator = Coordinator(min_replicas=1, first_quorum=2).start()   # launcher
    os.environ[settings.FT_COORDINATOR.name] = coordinator.address_text # for the ranks
    ...                                  # each rank: parallel.ft.Manager(...)
    coordinator.close()
"""

from __future__ import annotations

import socket
import socketserver
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from .quorum import Ask, Plan, plan_quorum
from .wire import read_message, write_message

__all__ = ["Coordinator"]

#: Decided commits kept for late voters (a member that was stopped while the others
#: decided); older ones are forgotten.
_KEPT_DECISIONS = 256


@dataclass
class _Round:
    asks: dict[str, Ask] = field(default_factory=dict)
    opened_at: float = 0.0
    plan: Optional[Plan] = None


@dataclass
class _Vote:
    members: tuple[str, ...]
    votes: dict[str, bool] = field(default_factory=dict)
    decision: Optional[bool] = None


class Coordinator:
    """Quorums and commit decisions for the replicas of one job (see the module
    docstring). ``start()`` serves on ``host:port`` (0: a free port) from a thread;
    ``close()`` stops it. Every wait is bounded by ``request_timeout``."""

    def __init__(self, *, min_replicas: int = 1, first_quorum: Optional[int] = None,
                 heartbeat_timeout: float = 2.0, join_timeout: float = 5.0,
                 request_timeout: float = 120.0, host: str = "127.0.0.1",
                 port: int = 0) -> None:
        if isinstance(min_replicas, bool) or not isinstance(min_replicas, int) \
                or min_replicas < 1:
            raise ValueError(f"Coordinator: argument `min_replicas` must be an int >= 1, "
                             f"got {min_replicas!r}")
        for name, value in (("heartbeat_timeout", heartbeat_timeout),
                            ("join_timeout", join_timeout),
                            ("request_timeout", request_timeout)):
            if not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"Coordinator: argument `{name}` must be a positive number "
                                 f"of seconds, got {value!r}")
        self.min_replicas = min_replicas
        self.first_quorum = max(min_replicas, first_quorum or min_replicas)
        self.heartbeat_timeout = float(heartbeat_timeout)
        self.join_timeout = float(join_timeout)
        self.request_timeout = float(request_timeout)
        self._host, self._port = host, port
        self._cond = threading.Condition()
        self._seen: dict[str, float] = {}           # replica id -> last heartbeat
        self._round = _Round()
        self._members: tuple[str, ...] = ()
        self._quorum_id = 0
        self._quorums: dict[int, tuple[str, ...]] = {}
        self._votes: dict[tuple[int, int], _Vote] = {}
        self._finished = False
        self._server: Optional[socketserver.ThreadingTCPServer] = None
        self._thread: Optional[threading.Thread] = None
        #: Decisions so far: quorums formed, steps committed and not (for reports).
        self.history: list[dict[str, Any]] = []

    # ----------------------------------------------------------------- serving
    def start(self) -> "Coordinator":
        """Serve from a daemon thread; returns self (``address`` is then known)."""
        coordinator = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                while True:
                    try:
                        request = read_message(self.rfile)
                    except (EOFError, OSError, ValueError):
                        return
                    try:
                        answer = coordinator.answer(request)
                    except (KeyError, TypeError, ValueError) as exc:
                        answer = {"error": f"{type(exc).__name__}: {exc}"}
                    try:
                        write_message(self.connection, answer)
                    except OSError:
                        return

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self._server = Server((self._host, self._port), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name="ft-coordinator", daemon=True)
        self._thread.start()
        return self

    @property
    def address(self) -> tuple[str, int]:
        if self._server is None:
            raise RuntimeError("Coordinator: not started (call start())")
        host, port = self._server.server_address[:2]
        return host, port

    @property
    def address_text(self) -> str:
        """``host:port``, the form ``COLLECTIVES_FT_COORDINATOR`` takes."""
        host, port = self.address
        return f"{host}:{port}"

    def close(self) -> None:
        """Stop serving (waiting requests end with their connections). Idempotent."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        with self._cond:
            self._finished = True
            self._cond.notify_all()

    def forget(self, replica_id: str) -> None:
        """Treat ``replica_id`` as dead now (the launcher saw its process end): the next
        quorum goes on without waiting for its heartbeat to expire."""
        with self._cond:
            self._seen.pop(replica_id, None)
            self._cond.notify_all()

    # ---------------------------------------------------------------- answering
    def answer(self, request: dict) -> dict:
        """The answer to one request (what the server sends back)."""
        op, replica = request["op"], str(request["id"])
        now = time.monotonic()
        with self._cond:
            if op == "heartbeat":
                self._seen[replica] = now
                return {"ok": True}
            if op == "leave":
                self._seen.pop(replica, None)
                self._finished = self._finished or bool(request.get("finished"))
                self._cond.notify_all()
                return {"ok": True}
            if op == "quorum":
                return self._quorum(replica, request, now)
            if op == "commit":
                return self._commit(replica, int(request["quorum_id"]), int(request["step"]),
                                    bool(request["ok"]))
        raise ValueError(f"unknown op {op!r}")

    def _live(self, now: float) -> set[str]:
        return {r for r, t in self._seen.items() if now - t < self.heartbeat_timeout}

    def _quorum(self, replica: str, request: dict, now: float) -> dict:
        if self._finished:
            return {"done": True}
        self._seen[replica] = now
        rnd = self._round
        if not rnd.asks:
            rnd.opened_at = now
        rnd.asks[replica] = Ask(step=int(request["step"]),
                                quorum_id=int(request.get("quorum_id", 0)),
                                broken=bool(request.get("broken")),
                                fresh=bool(request.get("fresh")))
        self._cond.notify_all()
        deadline = now + self.request_timeout
        while rnd.plan is None:
            now = time.monotonic()
            if self._finished:
                return {"done": True}
            if now > deadline:
                rnd.asks.pop(replica, None)
                raise ValueError(f"no quorum of at least {self.min_replicas} formed within "
                                 f"{self.request_timeout:g} s")
            self._maybe_close(rnd, now)
            if rnd.plan is None:
                self._cond.wait(0.05)
        plan = rnd.plan
        if replica not in plan.members:   # asked, then went silent: ask again
            return {"retry": True}
        return {"quorum_id": plan.quorum_id, "members": list(plan.members),
                "rank": plan.members.index(replica), "size": len(plan.members),
                "step": plan.step, "source": plan.source, "healers": list(plan.healers)}

    def _maybe_close(self, rnd: _Round, now: float) -> None:
        live = self._live(now)
        asked = {r for r in rnd.asks if r in live}
        needed = self.first_quorum if self._quorum_id == 0 else self.min_replicas
        if len(asked) < needed:
            return
        if live - asked and now - rnd.opened_at < self.join_timeout:
            return
        asks = {r: a for r, a in rnd.asks.items() if r in asked}
        plan = plan_quorum(asks, self._members, self._quorum_id)
        rnd.plan = plan
        if plan.quorum_id != self._quorum_id:
            self.history.append({"event": "quorum", "quorum_id": plan.quorum_id,
                                 "size": len(plan.members), "step": plan.step,
                                 "healers": len(plan.healers), "members": plan.members,
                                 "time": time.time()})
        self._members, self._quorum_id = plan.members, plan.quorum_id
        self._quorums[plan.quorum_id] = plan.members
        self._round = _Round()
        self._cond.notify_all()

    def _commit(self, replica: str, quorum_id: int, step: int, ok: bool) -> dict:
        members = self._quorums.get(quorum_id)
        if members is None or replica not in members:
            return {"commit": False}
        key = (quorum_id, step)
        vote = self._votes.get(key)
        if vote is None:
            vote = self._votes[key] = _Vote(members)
            for old in sorted(self._votes)[:-_KEPT_DECISIONS]:
                del self._votes[old]
        vote.votes[replica] = ok
        self._seen[replica] = time.monotonic()
        self._cond.notify_all()
        deadline = time.monotonic() + self.request_timeout
        while vote.decision is None:
            now = time.monotonic()
            live = self._live(now)
            if not all(vote.votes.values()):
                vote.decision = False
            elif len(vote.votes) == len(vote.members):
                vote.decision = True
            elif any(m not in vote.votes and m not in live for m in vote.members) \
                    or now > deadline:
                vote.decision = False
            else:
                self._cond.wait(0.05)
                continue
            self.history.append({"event": "commit" if vote.decision else "skip",
                                 "quorum_id": quorum_id, "step": step, "time": time.time()})
            self._cond.notify_all()
        return {"commit": vote.decision}
