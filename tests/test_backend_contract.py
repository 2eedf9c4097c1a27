"""A backend written from ``collectives.backend``'s docstring alone, and checked like the
library's own: the whole hypothesis conformance sweep, sub-groups, object collectives and
``abort()``.

``TcpBackend`` carries point to point over plain TCP sockets (length-prefixed frames, one
reader thread per peer, a queue per (peer, tag)); every collective comes from the
``Backend`` defaults. It is what a third party would write on day one.
"""

from __future__ import annotations

import queue
import socket
import struct
import threading
import time

import numpy as np
import pytest

import collectives
from collectives import Backend, CollectiveError, CollectiveTimeout, PeerError, Work
from collectives.testing import check_backend
from collectives.work import CompletedWork

_FRAME = struct.Struct("<QQ")   # tag, payload bytes


class _Receive(Work):
    def __init__(self, backend: "TcpBackend", src: int, tag: int, array: np.ndarray) -> None:
        self.backend, self.src, self.tag, self.array, self.done = backend, src, tag, array, False

    def wait(self, timeout=None) -> None:
        deadline = time.monotonic() + (self.backend.timeout if timeout is None else timeout)
        box = self.backend.box(self.src, self.tag)
        while not self.done:
            if self.backend.aborted.is_set():
                raise CollectiveError(f"{self.backend.where('recv')}: aborted")
            try:
                data = box.get(timeout=min(0.1, max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                if self.src in self.backend.gone:
                    raise PeerError(f"{self.backend.where('recv')}: rank {self.src} is gone",
                                    peer=self.src) from None
                if time.monotonic() >= deadline:
                    raise CollectiveTimeout(f"{self.backend.where('recv')}: nothing from rank "
                                            f"{self.src} (tag {self.tag})",
                                            missing=[self.src]) from None
                continue
            self.array.view(np.uint8)[:] = np.frombuffer(data, np.uint8)
            self.done = True

    def is_completed(self) -> bool:
        return self.done


class TcpBackend(Backend):
    name = "tcp-test"

    def __init__(self, rendezvous, timeout: float) -> None:
        super().__init__(rendezvous.rank, rendezvous.world_size, timeout)
        self.aborted, self.gone = threading.Event(), set()
        self.boxes, self.boxes_lock = {}, threading.Lock()
        self.socks = _connect(rendezvous, timeout)
        self.locks = {peer: threading.Lock() for peer in self.socks}
        self.readers = [threading.Thread(target=self.read, args=(p, s), daemon=True)
                        for p, s in self.socks.items()]
        for t in self.readers:
            t.start()

    def box(self, peer: int, tag: int) -> queue.SimpleQueue:
        with self.boxes_lock:
            return self.boxes.setdefault((peer, tag), queue.SimpleQueue())

    def read(self, peer: int, sock: socket.socket) -> None:
        try:
            while True:
                tag, n = _FRAME.unpack(_exactly(sock, _FRAME.size))
                self.box(peer, tag).put(_exactly(sock, n))
        except OSError:   # the peer closed or died, or we closed
            self.gone.add(peer)

    def isend(self, array: np.ndarray, dst: int, tag: int) -> Work:
        if self.aborted.is_set() or dst in self.gone:
            raise PeerError(f"{self.where('send')}: rank {dst} is gone", peer=dst)
        with self.locks[dst]:
            self.socks[dst].sendall(_FRAME.pack(tag, array.nbytes) + array.tobytes())
        return CompletedWork()

    def irecv(self, array: np.ndarray, src: int, tag: int) -> Work:
        return _Receive(self, src, tag, array)

    def close(self) -> None:
        for sock in self.socks.values():
            sock.close()

    def abort(self) -> None:
        self.aborted.set()
        for sock in self.socks.values():
            sock.shutdown(socket.SHUT_RDWR)
        self.close()


def _exactly(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return bytes(data)


def _connect(rv, timeout: float) -> dict:
    """Rank r listens on MASTER_PORT + 1 + r; every rank dials the lower ranks."""
    socks, deadline = {}, time.monotonic() + timeout
    me = socket.create_server((rv.master_addr, rv.master_port + 1 + rv.rank))
    for peer in range(rv.rank):
        while True:
            try:
                s = socket.create_connection((rv.master_addr, rv.master_port + 1 + peer))
                break
            except ConnectionRefusedError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        s.sendall(struct.pack("<Q", rv.rank))
        socks[peer] = s
    for _ in range(rv.rank + 1, rv.world_size):
        s, _ = me.accept()
        socks[struct.unpack("<Q", _exactly(s, 8))[0]] = s
    me.close()
    for s in socks.values():
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return socks


def register() -> None:
    collectives.register_backend("tcp-test", TcpBackend, replace=True)


# ------------------------------------------------------------------------------ tests
@pytest.mark.timeout(600)
def test_a_backend_of_only_point_to_point_passes_the_conformance_sweep():
    """The hypothesis sweep of every collective (the Backend defaults over its point to
    point), at 1 to 3 ranks, in worker processes that register it first."""
    check_backend("tcp-test", world_sizes=(1, 2, 3), max_examples=40, kinds=("numpy",),
                  initializer=register, timeout=30)


def _sub_groups_and_objects() -> list:
    register()
    pg = collectives.init_process_group("tcp-test")
    pair = pg.new_group([0, 1])
    t = np.full(3, pg.rank + 1.0)
    pair.all_reduce(t)
    names = pg.all_gather_object(f"rank{pg.rank}")
    described = pg.describe()
    pair.close()
    pg.close()
    return [t.tolist(), names, "recursive doubling" in described]


def test_sub_groups_objects_and_describe_come_with_the_defaults():
    results = collectives.spawn(_sub_groups_and_objects, 2, timeout=60)
    for values, names, described in results:
        assert values == [3.0] * 3 and names == ["rank0", "rank1"] and described


def _aborted_while_the_peer_sleeps() -> dict:
    register()
    pg = collectives.init_process_group("tcp-test", timeout=60)
    if pg.rank == 1:
        time.sleep(3)   # never calls the all_reduce rank 0 waits in
        pg.close()
        return {}
    threading.Timer(0.5, pg.abort).start()
    t0 = time.monotonic()
    try:
        pg.all_reduce(np.ones(4))
        raised = None
    except collectives.GroupAborted as exc:
        raised = str(exc)
    waited = time.monotonic() - t0
    try:
        pg.barrier()
        later = None
    except collectives.GroupAborted as exc:
        later = str(exc)
    return {"raised": raised, "waited": waited, "later": later}


def test_abort_ends_a_pending_collective_and_every_later_call():
    result = collectives.spawn(_aborted_while_the_peer_sleeps, 2, timeout=60)[0]
    assert result["raised"] and "[rank 0/2] all_reduce (seq 0)" in result["raised"]
    assert result["waited"] < 0.5 + 1.0 + 1.0, result   # abort at 0.5 s, ends within 1 s
    assert result["later"] and "barrier" in result["later"] and "aborted" in result["later"]
