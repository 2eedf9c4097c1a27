"""``parallel.ft`` piece by piece, in one process: the quorum decision (pure), the
coordinator's rounds and commit decisions (replicas as threads), healing's chunks and
checksums (a world of one sending to itself), the manager's no-op collectives, and
``FaultTolerantDDP``'s batch split. The end-to-end runs with faults are in
``tests/test_ft_faults.py``."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

import collectives
from parallel.ft import (Ask, Coordinator, FaultTolerantDDP, HealingCorrupted, Manager,
                         plan_quorum, split_batch)
from parallel.ft import healing
from parallel.ft.client import CoordinatorClient, parse_address
from parallel.ft.wire import CoordinatorUnreachable


# ------------------------------------------------------------------- the decision
def test_first_quorum_has_no_source_and_a_new_id():
    plan = plan_quorum({"a": Ask(0, fresh=True), "b": Ask(0, fresh=True)}, (), 0)
    assert plan.members == ("a", "b") and plan.quorum_id == 1
    assert plan.source is None and plan.healers == ()


def test_same_members_healthy_keep_the_quorum():
    asks = {"b": Ask(5, quorum_id=3), "a": Ask(5, quorum_id=3)}
    plan = plan_quorum(asks, ("a", "b"), 3)
    assert plan.members == ("a", "b") and plan.quorum_id == 3 and plan.source is None


@pytest.mark.parametrize("asks", [
    {"a": Ask(5, quorum_id=3, broken=True), "b": Ask(5, quorum_id=3)},   # a failed step
    {"a": Ask(5, quorum_id=3), "b": Ask(5, quorum_id=2)},                # a stale group
    {"a": Ask(5, quorum_id=3)},                                           # b is gone
])
def test_a_failure_or_a_change_makes_a_new_quorum(asks):
    assert plan_quorum(asks, ("a", "b"), 3).quorum_id == 4


def test_new_and_behind_replicas_heal_from_the_first_at_the_highest_step():
    asks = {"c": Ask(0, fresh=True), "a": Ask(4, quorum_id=3), "b": Ask(6, quorum_id=3),
            "d": Ask(6, quorum_id=3)}
    plan = plan_quorum(asks, ("a", "b", "d"), 3)
    assert plan.members == ("a", "b", "d", "c")
    assert plan.step == 6 and plan.source == 1 and plan.healers == (0, 3)


def test_plan_refuses_an_empty_round():
    with pytest.raises(ValueError, match="no replica asked"):
        plan_quorum({}, (), 0)


# ---------------------------------------------------------------- the coordinator
def _clients(coordinator, names):
    clients = [CoordinatorClient(coordinator.address_text, n, timeout=20.0) for n in names]
    for c in clients:
        c.start_heartbeats(0.05)
    return clients


def _together(calls):
    out = [None] * len(calls)

    def run(i, f):
        out[i] = f()
    threads = [threading.Thread(target=run, args=(i, f)) for i, f in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_commit_is_all_or_nothing_and_the_same_for_late_voters():
    coordinator = Coordinator(first_quorum=3, heartbeat_timeout=0.5).start()
    a, b, c = clients = _clients(coordinator, "abc")
    try:
        q = _together([lambda x=x: x.quorum(step=0, quorum_id=0, broken=False, fresh=True)
                       for x in clients])
        assert [r["rank"] for r in q] == [0, 1, 2] and {r["quorum_id"] for r in q} == {1}
        assert _together([lambda x=x: x.commit(quorum_id=1, step=0, ok=True)
                          for x in clients]) == [True] * 3
        # one failure: nobody commits, including a voter that comes after the decision
        assert _together([lambda: a.commit(quorum_id=1, step=1, ok=True),
                          lambda: b.commit(quorum_id=1, step=1, ok=False)]) == [False, False]
        assert c.commit(quorum_id=1, step=1, ok=True) is False
        # a member that goes silent before voting fails the commit for the others
        c.close()
        start = time.monotonic()
        assert _together([lambda: a.commit(quorum_id=1, step=2, ok=True),
                          lambda: b.commit(quorum_id=1, step=2, ok=True)]) == [False, False]
        assert time.monotonic() - start < 5
        q = _together([lambda: a.quorum(step=2, quorum_id=1, broken=True, fresh=False),
                       lambda: b.quorum(step=2, quorum_id=1, broken=True, fresh=False)])
        assert [r["members"] for r in q] == [["a", "b"]] * 2 and q[0]["quorum_id"] == 2
    finally:
        for x in clients:
            x.close()
        coordinator.close()


def test_min_replicas_holds_the_round_and_forget_releases_it():
    coordinator = Coordinator(min_replicas=2, first_quorum=2, heartbeat_timeout=30.0,
                              join_timeout=30.0).start()
    a, b = _clients(coordinator, "ab")
    try:
        _together([lambda x=x: x.quorum(step=0, quorum_id=0, broken=False, fresh=True)
                   for x in (a, b)])
        done = []
        t = threading.Thread(target=lambda: done.append(
            a.quorum(step=0, quorum_id=1, broken=True, fresh=False)))
        t.start()
        time.sleep(0.5)
        assert not done                       # b is live: the round waits for it
        coordinator.forget("b")               # b died: still only one, below min 2
        b.close()
        time.sleep(0.5)
        assert not done
    finally:
        coordinator.close()                   # ends the waiting request
        t.join(10)
        a.close()


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="min_replicas"):
        Coordinator(min_replicas=0)
    with pytest.raises(ValueError, match="heartbeat_timeout"):
        Coordinator(heartbeat_timeout=0)
    with pytest.raises(ValueError, match="host:port"):
        parse_address("nowhere")
    with pytest.raises(ValueError, match="no coordinator"):
        Manager(state_dict=dict, load_state_dict=print, coordinator="")
    with pytest.raises(CoordinatorUnreachable, match="did not answer 'quorum'"):
        CoordinatorClient("127.0.0.1:1", "x", timeout=0.5).quorum(
            step=0, quorum_id=0, broken=False, fresh=True)


# ------------------------------------------------------------------------ healing
class _Mailbox:
    """A stand-in group of two ranks in one process: what rank 0 sends, rank 1 receives
    (healing uses only send, recv and the transport's decode_object)."""

    def __init__(self, rank: int, box: list) -> None:
        self.rank, self.size, self.box = rank, 2, box
        self.transport = collectives.Backend.__new__(_Decoder)

    def send(self, array, dst, tag):
        self.box.append(np.array(array, copy=True))

    def recv(self, array, src, tag):
        array[...] = self.box.pop(0)


class _Decoder(collectives.Backend):
    isend = irecv = close = abort = None


def test_healing_is_chunked_checksummed_and_bitwise(monkeypatch):
    box: list = []
    source, healer = _Mailbox(0, box), _Mailbox(1, box)
    state = {"w": torch.randn(1000, dtype=torch.float32), "step": 3,
             "m": torch.tensor([float("nan"), -0.0])}
    sent = healing.send_state(source, 1, state, chunk_bytes=1000)
    assert len(box) == 2 + -(-sent // 1000)               # header, checksums, chunks
    got = healing.receive_state(healer, 0)
    assert sent > 4000 and got["step"] == 3
    assert got["w"].numpy().tobytes() == state["w"].numpy().tobytes()
    assert got["m"].numpy().tobytes() == state["m"].numpy().tobytes()
    healing.send_state(source, 1, state, chunk_bytes=1000)
    box[3][7] ^= 1                                         # a torn chunk (the second)
    with pytest.raises(HealingCorrupted, match=r"\[rank 1/2\] receive_state from rank 0: "
                                               r"chunk 1 of \d+"):
        healing.receive_state(healer, 0)


# ------------------------------------------------------------------- the manager
def test_a_failed_collective_makes_the_rest_of_the_step_no_ops():
    coordinator = Coordinator(first_quorum=1, heartbeat_timeout=5.0).start()
    manager = Manager(state_dict=dict, load_state_dict=print,
                      coordinator=coordinator.address_text, backend="shm", timeout=5.0)
    try:
        assert manager.start_step() and manager.size == 1
        t = np.ones(4)
        assert manager.all_reduce(t) and manager.should_commit() and manager.step == 1
        manager.start_step()
        manager.group.abort("injected")               # as if a peer had died
        assert manager.all_reduce(t) is False and manager.errored is not None
        assert manager.all_reduce(t) is False         # no-op, no exception
        assert manager.should_commit() is False and manager.step == 1
        assert manager.start_step() and manager.errored is None and manager.quorum_id == 2
        assert manager.all_reduce(t) and manager.should_commit() and manager.step == 2
        with pytest.raises(TypeError):                # bad arguments still raise
            manager.all_reduce("not a tensor")
    finally:
        manager.close(finished=True)
        coordinator.close()


def test_split_batch_covers_every_sample_once():
    idx = np.arange(10)
    for size in (1, 3, 4, 11):
        parts = [split_batch(idx, r, size) for r in range(size)]
        assert np.concatenate(parts).tolist() == idx.tolist()


def test_fault_tolerant_ddp_checks_its_arguments():
    with pytest.raises(TypeError, match="parallel.ft.Manager"):
        FaultTolerantDDP(torch.nn.Linear(2, 2), object(), dataset_size=4, global_batch=2)
