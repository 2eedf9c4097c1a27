"""Where the ranks of a torch backend meet: the c10d store of ``MASTER_ADDR:MASTER_PORT``,
shared by every group of this process on that port and released when the last one
closes (:class:`Meeting`, with the open/close handshake that keeps rank 0's server from
going away under a rank that still needs it).

Used by :mod:`backends.torchdist`: ``world_store(rendezvous, timeout)`` gives a new
world its store and key prefix; ``construct`` builds a c10d object with this library's
errors.
"""

from __future__ import annotations

import atexit
import datetime
import os
import re
import threading
import time
from typing import Any, Callable

import torch.distributed as dist

from collectives import logs
from collectives.errors import CollectiveError, CollectiveTimeout, PeerError
from collectives.errors import where as _where
from collectives.launch import Rendezvous

#: The store of each meeting point this process uses (shared by the groups on it), and
#: how many worlds this process opened there (the next world's key prefix; kept when the
#: store is released, so that a later world there never meets stale keys).
_STORES: dict[tuple, "Meeting"] = {}
_WORLD_COUNTS: dict[tuple, int] = {}
_STORES_LOCK = threading.RLock()
_log = logs.get_logger("backend.torch")

#: Keys of the open/close handshake of rank 0's server (see `Meeting`), per world index.
_OPEN_KEY = "collectives/meeting/open/"
_CLOSED_KEY = "collectives/meeting/closed/"
#: How long rank 0, at its last close, waits for the other ranks' reports that they
#: closed theirs, before it stops its server anyway (a late rank's report is lost: it
#: no longer needs the store, which only set up the groups).
_CLOSE_WAIT_S = 5.0


class Meeting:
    """One c10d store of a meeting point, counted: every group on it (a world and its
    sub-groups) holds one reference, and the store is released when the last one closes,
    so a process that meets at many ports keeps no socket or thread for the closed ones.

    Where rank 0 serves the store (not under torchrun, whose agent serves it for the
    whole job), two rules keep its server from going away under a rank that needs it:

    - at its last close every other rank reports on the store that it closed its groups
      of world k (``closed/k``) and disconnects at once; rank 0 waits (up to
      ``_CLOSE_WAIT_S``) for every report, then lets the server go. No request of a
      client is pending when the server goes, so torch prints nothing (a client blocked
      in a wait that the server's stop broke made torch print a warning with a 24-frame
      C++ stack, in runs that went well). A close is thus collective, as a group's close
      is anyway;
    - a rank that connects for world k first asks the server it reached for
      ``closed/k-1``: there, it is the last world's server, still waiting for the other
      ranks' reports, and the rank comes back 50 ms later instead of waiting on it. On
      the right server it waits until rank 0 wrote ``open/k``, which rank 0 writes only
      on the server it opened world k with, so no rank settles on a dying server.

    Each world's keys live under a prefix of their own, so a server that outlived a close
    (torch's multi-tenant sharing, or a broken world kept alive) is reused safely.
    """

    def __init__(self, key: tuple, store: Any, *, serving: bool, handshake: bool) -> None:
        self.key, self.store = key, store
        self.serving = serving      # rank 0 serves it
        self.handshake = handshake  # rank 0's server: the open/close reports apply
        self.users = 0              # groups of this process using it
        self.world = -1             # index of the last world opened on it
        self.world_size = 1

    def acquire(self) -> None:
        with _STORES_LOCK:
            self.users += 1

    def release(self, *, broken: bool = False) -> None:
        """One group on the store is gone; at the last one, release the store: a client
        of rank 0's server reports its close, rank 0 waits for those reports (not when
        ``broken``: a member died, and dead ranks report nothing)."""
        with _STORES_LOCK:
            self.users -= 1
            if self.users > 0:
                return
            store, closed = self.store, f"{_CLOSED_KEY}{self.world}"
            self._forget()
        if not self.handshake or broken or store is None:
            return
        try:
            if not self.serving:
                # Report and disconnect: nothing of ours is pending on the server when it
                # goes, so torch has nothing to warn about. A rank that comes back for its
                # next world at once may reach this server still; it sees this report
                # there and waits for the next server (see `_open_store`).
                store.add(closed, 1)
                return
            deadline = time.monotonic() + _CLOSE_WAIT_S
            while store.add(closed, 0) < self.world_size - 1 and time.monotonic() < deadline:
                time.sleep(0.002)
        except RuntimeError:  # the server is gone already, or a report could not land
            pass

    def _forget(self) -> None:
        if _STORES.get(self.key) is self:
            del _STORES[self.key]
        self.store = None  # the server (or client) goes with the last reference


def world_store(rendezvous: Rendezvous, timeout: float) -> tuple[Meeting, str]:
    """The store of ``rendezvous``'s meeting point (one reference taken for the caller's
    world) and the key prefix of that world."""
    rank, size = rendezvous.rank, rendezvous.world_size
    if rendezvous.master_port is None:
        if size != 1:
            raise ValueError(f"{_where(rank, size, 'init_process_group')}: the torch backends "
                             f"need MASTER_ADDR and MASTER_PORT (collectives.spawn and torchrun "
                             f"set them)")
        key: tuple = ("hash", os.getpid())
    else:
        key = (rendezvous.master_addr or "127.0.0.1", rendezvous.master_port)
    with _STORES_LOCK:
        count = _WORLD_COUNTS.get(key, 0)
        meeting = _STORES.get(key)
        if meeting is None:
            meeting = _STORES[key] = _open_store(key, rendezvous, timeout, count)
        elif meeting.serving and meeting.handshake:
            construct(lambda: meeting.store.set(f"{_OPEN_KEY}{count}", "1"),
                       _where(rank, size, "init_process_group"), timeout)
        meeting.acquire()
        meeting.world, meeting.world_size = count, size
        _WORLD_COUNTS[key] = count + 1
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return meeting, f"collectives/{restart}/world{count}/"


def _open_store(key: tuple, rendezvous: Rendezvous, timeout: float, world: int) -> Meeting:
    """Connect to (or serve) the store of meeting point ``key`` for world number
    ``world`` there (see `Meeting` for the open/close handshake)."""
    if key[0] == "hash":
        return Meeting(key, dist.HashStore(), serving=False, handshake=False)
    addr, port = key
    # Under torchrun the agent serves MASTER_PORT already: everyone is a client then
    # (collectives.spawn run inside a torchrun worker picks a port of its own).
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" \
        and rendezvous.launcher != "spawn"
    serve = rendezvous.rank == 0 and not agent
    where = _where(rendezvous.rank, rendezvous.world_size, "init_process_group")
    # multi_tenant: torch.distributed.init_process_group("gloo") in this process, on the
    # same port, shares the server instead of failing to bind it (as torch's own does).
    what = f"{where}: store at {addr}:{port} ({'serving' if serve else 'client'})"

    def connect(seconds: float) -> Any:
        return construct(lambda: dist.TCPStore(
            addr, port, rendezvous.world_size, is_master=serve,
            timeout=datetime.timedelta(seconds=seconds), wait_for_workers=False,
            multi_tenant=serve), what, seconds)

    _log.debug("%s: opening world %d", what, world)
    if agent:  # the agent's server lives as long as the job: no handshake
        return Meeting(key, connect(timeout), serving=False, handshake=False)
    if serve:
        store = connect(timeout)
        construct(lambda: store.set(f"{_OPEN_KEY}{world}", "1"), what, timeout)
        return Meeting(key, store, serving=True, handshake=True)
    deadline = time.monotonic() + timeout
    opening = logs.Awaiting(_log, f"rank 0 to open world {world} on the store at {addr}:{port}")
    while True:
        remaining = max(0.001, deadline - time.monotonic())
        store = connect(remaining)
        try:
            # Polled, never a blocking wait: a wait that the stop of the last world's
            # server breaks makes torch print a warning with a C++ stack.
            opened = f"{_OPEN_KEY}{world}"
            while not store.check([opened]):
                opening.still([0])
                if world > 0 and store.check([f"{_CLOSED_KEY}{world - 1}"]):
                    # The server of the last world, which rank 0 lets go once every
                    # rank reported: come back for the next one.
                    raise _OldServer(f"rank 0 still serves world {world - 1} at this port")
                if time.monotonic() >= deadline:
                    raise RuntimeError(f"no {opened} on the server")
                time.sleep(0.002)
            store.set_timeout(datetime.timedelta(seconds=timeout))
            opening.done()
            return Meeting(key, store, serving=False, handshake=True)
        except RuntimeError as exc:
            del store  # rank 0's server of the previous world stopped under us
            _log.debug("%s: %s; connecting again", what, first_line(exc))
            if time.monotonic() >= deadline:
                raise CollectiveTimeout(f"{what}: rank 0 did not open world {world} at this "
                                        f"port within {timeout:g} s ({first_line(exc)})",
                                        op="init", missing=[0]) from exc
            # A server on its way out takes some milliseconds to go: each request that
            # reaches it meanwhile makes torch print a warning, so do not hammer it.
            time.sleep(0.05 if isinstance(exc, _OldServer) else 0.005)


class _OldServer(RuntimeError):
    """The store a joining rank reached is the last world's, which is going away."""


def construct(make: Callable[[], Any], where: str, timeout: float) -> Any:
    """Build a c10d object, turning connection failures into this library's errors."""
    try:
        return make()
    except CollectiveError:
        raise  # already ours (a transport of this library under the collectives backend)
    except RuntimeError as exc:
        detail = first_line(exc)
        if "timed out" in detail.lower() or "timeout" in detail.lower():
            raise CollectiveTimeout(f"{where}: not every rank arrived within {timeout:g} s "
                                    f"({detail})", op="init") from exc
        raise PeerError(f"{where}: could not connect: {detail}") from exc



def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    line = text.splitlines()[0] if text else type(exc).__name__
    # gloo prefixes its messages with the C++ source location.
    return re.sub(r"^\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*", "", line)


@atexit.register
def _release_stores_at_exit() -> None:
    # (the groups themselves are closed by collectives.lifetime's exit hook, registered
    # earlier, so run later: atexit hooks run last in, first out)
    with _STORES_LOCK:
        for meeting in list(_STORES.values()):
            meeting.store = None
        _STORES.clear()

