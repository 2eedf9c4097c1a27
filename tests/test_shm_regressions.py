"""Regressions found by the algorithm and conformance suites on the shm backend."""

from __future__ import annotations

import numpy as np

import collectives


def _empty_messages_on_a_ring():
    with collectives.init_process_group(timeout=20) as pg:
        n, r = pg.size, pg.rank
        for _ in range(20):  # several empty messages on one pair and tag, in order
            w = pg.isend(np.empty(0, np.float32), (r + 1) % n, tag=5)
            pg.irecv(np.empty(0, np.float32), (r - 1) % n, tag=5).wait()
            w.wait()
        pg.barrier()
        return True


def _init_then_close():
    pg = collectives.init_process_group(timeout=20)
    pg.close()  # a fast rank closes while slower ones are still attaching
    return True


def test_repeated_empty_messages_are_delivered():
    assert collectives.spawn(_empty_messages_on_a_ring, 3, backend="shm") == [True] * 3


def test_a_rank_may_close_while_others_still_attach():
    for _ in range(2):
        assert collectives.spawn(_init_then_close, 4, backend="shm") == [True] * 4
