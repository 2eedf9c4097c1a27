"""Training that survives a dead rank, modelled on torchft, against ``collectives`` only.

The pieces, one module each:

- :mod:`parallel.ft.coordinator`: decides each step's participants (the quorum) and
  whether each step is committed; lives in the launcher and is reached over TCP, so it
  outlives any rank; heartbeats and ``min_replicas``.
- :mod:`parallel.ft.quorum`: the decision itself, as pure functions.
- :mod:`parallel.ft.manager`: ``Manager``, a replica's side: per step, the quorum, the
  group re-formed when it changed (``ProcessGroup.reform``), healing, the all_reduce
  that turns failures into no-ops, ``should_commit()``.
- :mod:`parallel.ft.healing`: a new or behind replica receives the state from a healthy
  one over the group, chunked and checksummed.
- :mod:`parallel.ft.ddp`: ``FaultTolerantDDP``, each step's global batch split among
  that step's participants.
- :mod:`parallel.ft.client`, :mod:`parallel.ft.wire`: the coordinator's requests.

``examples/elastic.py`` puts them together; docs/fault-tolerance.md describes the
recovery and its measured times.

Two replicas, each (the launcher runs ``Coordinator(...).start()``)::

    manager = Manager(state_dict=..., load_state_dict=..., coordinator="127.0.0.1:29400")
    model = FaultTolerantDDP(net, manager, dataset_size=60000, global_batch=64)
"""

from .coordinator import Coordinator
from .ddp import FaultTolerantDDP, split_batch
from .healing import HealingCorrupted, receive_state, send_state
from .manager import Manager
from .quorum import Ask, Plan, plan_quorum

__all__ = ["Ask", "Coordinator", "FaultTolerantDDP", "HealingCorrupted", "Manager", "Plan",
           "plan_quorum", "receive_state", "send_state", "split_batch"]
