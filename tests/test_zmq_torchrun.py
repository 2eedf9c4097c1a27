"""zmq under torchrun: the agent's store holds MASTER_PORT, so rank 0 publishes a port of
its own there (backends/zeromq/torchrun.py)."""

from __future__ import annotations

import dataclasses
import datetime
import threading

import pytest

torch_dist = pytest.importorskip("torch.distributed")
from backends.zeromq import torchrun  # noqa: E402
from collectives.errors import CollectiveTimeout  # noqa: E402
from collectives.launch import detect_rendezvous  # noqa: E402
from collectives.spawn import free_port  # noqa: E402


def _env(rank: int, port: int, agent: str = "True") -> dict:
    return {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "TORCHELASTIC_USE_AGENT_STORE": agent, "TORCHELASTIC_RUN_ID": "t"}


def test_only_the_agents_port_is_replaced():
    env = _env(1, 29500)
    rdzv = detect_rendezvous(env=env)
    assert torchrun.agent_holds_port(rdzv, env)
    # older torch (no agent store), a port of the torch backend's own, a regroup: unchanged
    for other, e in ((rdzv, _env(1, 29500, agent="False")),
                     (dataclasses.replace(rdzv, master_port=40001), env),
                     (dataclasses.replace(rdzv, generation=1), env),
                     (dataclasses.replace(rdzv, launcher="spawn"), env)):
        assert not torchrun.agent_holds_port(other, e)
        assert torchrun.own_port(other, e, 1.0) is other


def test_every_rank_learns_rank_0s_port_from_the_agent_store():
    port = free_port()
    agent = torch_dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                                timeout=datetime.timedelta(seconds=10))
    got: dict = {}

    def rank(r: int) -> None:
        env = _env(r, port)
        got[r] = [torchrun.own_port(detect_rendezvous(env=env), env, 10.0).master_port
                  for _ in range(2)]   # two worlds in a row: a port each

    threads = [threading.Thread(target=rank, args=(r,)) for r in (1, 0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert got[0] == got[1] and len(set(got[0])) == 2 and port not in got[0]
    del agent


def test_rank_0_that_never_publishes_is_a_timeout_naming_it():
    port = free_port()
    agent = torch_dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                                timeout=datetime.timedelta(seconds=10))
    env = _env(1, port)
    with pytest.raises(CollectiveTimeout, match=r"\[rank 1/2\] zmq init: rank 0 did not "
                                                r"publish") as info:
        torchrun.own_port(detect_rendezvous(env=env), env, 0.5)
    assert info.value.missing == (0,)
    del agent
