"""collectives.subgroup: the sub-group a backend without its own communicators gets, a
view over the parent's point to point, names ranks in its own numbering."""

from __future__ import annotations

import numpy as np
import pytest

from collectives import PeerError
from collectives.subgroup import SubGroup
from collectives.testing.threads import run_threads


def test_a_failed_peer_is_named_by_its_rank_in_the_sub_group():
    """World ranks 1 and 2 form a sub-group; world rank 2 fails while world rank 1
    receives from it there: the PeerError names rank 1, the sub-group's number for it,
    not 2, the world's."""
    seen: dict = {}

    def fn(pg):
        if pg.rank == 0:
            return None
        sub = pg.new_group([1, 2])
        assert isinstance(sub.transport, SubGroup)
        if pg.rank == 2:
            raise RuntimeError("world rank 2 fails")
        try:
            sub.recv(np.empty(4), src=1)
        except PeerError as exc:
            seen.update(peer=exc.peer, message=str(exc))
        return None

    with pytest.raises(RuntimeError, match="world rank 2 fails"):
        run_threads(fn, 3, timeout=10.0)
    assert seen["peer"] == 1, seen
    assert seen["message"].startswith("[rank 0/2] recv: in the parent (ranks 1, 2): "
                                      "rank 1: "), seen["message"]
