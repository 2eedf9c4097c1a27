"""Start-up: environment detection, the backend registry, and collectives.spawn."""

from __future__ import annotations

import os
import time

import pytest

import collectives
from collectives import registry
from collectives.launch import default_backend, detect_rendezvous


# --------------------------------------------------------------------------- detection
def test_explicit_arguments_win_over_the_environment():
    env = {"RANK": "3", "WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "1"}
    r = detect_rendezvous(rank=0, world_size=2, env=env)
    assert (r.rank, r.world_size, r.launcher) == (0, 2, "explicit")


def test_torchrun_variables():
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.1",
           "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "abc"}
    r = detect_rendezvous(env=env)
    assert (r.rank, r.world_size, r.local_rank, r.launcher) == (1, 2, 1, "torchrun")
    assert (r.master_addr, r.master_port) == ("10.0.0.1", 29500)
    assert r.job_id == "TORCHELASTIC_RUN_ID=abc"
    assert default_backend(r, env={}) == "shm"


@pytest.mark.parametrize("env", [
    {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4",
     "OMPI_COMM_WORLD_LOCAL_RANK": "0"},
    {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0"},
])
def test_mpi_launcher_variables_select_mpi(env):
    r = detect_rendezvous(env=env)
    assert (r.rank, r.world_size, r.local_rank, r.launcher) == (2, 4, 0, "mpi")
    assert default_backend(r, env={}) == "mpi"
    assert default_backend(r, env={"COLLECTIVES_BACKEND": "shm"}) == "shm"


def test_no_launcher_is_a_world_of_one():
    r = detect_rendezvous(env={})
    assert (r.rank, r.world_size, r.launcher) == (0, 1, "single")
    assert r.job_id  # shm can still name its segment


@pytest.mark.parametrize("kwargs, env, error", [
    ({"rank": 0}, {}, ValueError),
    ({"rank": 2, "world_size": 2}, {}, ValueError),
    ({}, {"RANK": "0"}, ValueError),
    ({}, {"RANK": "zero", "WORLD_SIZE": "2"}, ValueError),
    ({"rank": "0", "world_size": 2}, {}, TypeError),
])
def test_bad_start_up_values_are_clear_errors(kwargs, env, error):
    with pytest.raises(error):
        detect_rendezvous(env=env, **kwargs)


def test_timeout_must_be_positive():
    with pytest.raises(ValueError, match="timeout"):
        collectives.init_process_group("shm", timeout=-1)


# ---------------------------------------------------------------------------- registry
def test_unknown_backend_names_the_known_ones():
    with pytest.raises(ValueError, match="known backends: .*shm"):
        registry.get_backend("carrier-pigeon")


def test_duplicate_registration_is_refused():
    with pytest.raises(ValueError, match="already registered"):
        registry.register_backend("shm", lambda *a: None)
    registry.register_backend("test-dummy", "nowhere.at.all:create")
    try:
        with pytest.raises(ValueError, match="already registered"):
            registry.register_backend("test-dummy", "nowhere.at.all:create")
        with pytest.raises(ImportError, match="test-dummy"):
            registry.get_backend("test-dummy")
        assert "test-dummy" in registry.available_backends()
    finally:
        registry._registered.pop("test-dummy")


def test_bad_factory_is_refused():
    with pytest.raises(TypeError):
        registry.register_backend("x", 42)


def test_available_backends_lists_shm():
    assert "shm" in collectives.available_backends()


def test_choosing_shm_imports_no_other_transport():
    import subprocess
    import sys
    code = ("import sys, collectives; collectives.get_backend('shm'); "
            "bad = [m for m in ('mpi4py', 'zmq', 'torch.distributed') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert out.returncode == 0, out.stdout + out.stderr


# ------------------------------------------------------------------------------- spawn
def _identity(rank_offset):
    return int(os.environ["RANK"]) + rank_offset, os.environ["WORLD_SIZE"]


def _fail_on_rank_one():
    if os.environ["RANK"] == "1":
        raise KeyError("the-missing-key")
    time.sleep(30)  # the launcher must stop this rank, not wait for it
    return "unreachable"


def _die_on_rank_zero():
    if os.environ["RANK"] == "0":
        os._exit(7)
    time.sleep(30)


def _world_of(backend):
    with collectives.init_process_group() as pg:
        import numpy as np
        t = np.full(3, pg.rank + 1.0, np.float32)
        pg.all_reduce(t)
        return pg.backend, pg.rank, pg.size, t.tolist()


def test_spawn_returns_results_in_rank_order():
    assert collectives.spawn(_identity, 3, args=(10,)) == [(10, "3"), (11, "3"), (12, "3")]


def test_spawn_reports_the_failing_rank_with_its_traceback_and_stops_the_others():
    start = time.monotonic()
    with pytest.raises(collectives.SpawnError) as info:
        collectives.spawn(_fail_on_rank_one, 3)
    assert time.monotonic() - start < 20
    err = info.value
    assert err.rank == 1
    assert "rank 1 failed: KeyError" in str(err)
    assert "the-missing-key" in err.remote_traceback
    assert isinstance(err.__cause__, KeyError)


def test_spawn_reports_a_rank_that_dies():
    with pytest.raises(collectives.SpawnError, match="rank 0 .*code 7") as info:
        collectives.spawn(_die_on_rank_zero, 2)
    assert info.value.exitcode == 7


def test_free_port_is_drawn_outside_the_kernels_ephemeral_range(monkeypatch):
    """A meeting port handed out by ``bind(port 0)`` can be taken by the next outgoing
    connection or ephemeral bind of any process (a CI failure: "rank 0 cannot listen ...
    Address already in use"); free_port draws outside that range, and the port binds on
    the loopback and on the wildcard."""
    import socket
    from collectives.spawn import _LOWEST_DRAWN_PORT, _ephemeral_range, free_port
    low, high = _ephemeral_range()
    if low - _LOWEST_DRAWN_PORT < 1000 and 65535 - high < 1000:
        pytest.skip(f"the ephemeral range {low}-{high} leaves no room outside it")
    ports = {free_port() for _ in range(20)}
    assert all(_LOWEST_DRAWN_PORT <= p < low or high < p <= 65535 for p in ports), \
        (ports, low, high)
    assert len(ports) > 1  # drawn, not one fixed port
    port = ports.pop()
    for address in ("127.0.0.1", "0.0.0.0"):
        with socket.socket() as s:
            s.bind((address, port))

    # a port held by a listener on another address (here the IPv4 wildcard) is skipped
    import importlib
    spawn = importlib.import_module("collectives.spawn")  # (the package exports a function)
    taken, spare = free_port(), free_port()
    drawn = iter([taken, spare])

    class Draws:
        def choices(self, spans, weights):
            return [spans[0]]

        def randrange(self, a, b):
            return next(drawn)

    with socket.socket() as s:
        s.bind(("0.0.0.0", taken))
        s.listen()
        assert not spawn._port_is_free(socket.AF_INET, "127.0.0.1", taken)
        monkeypatch.setattr(spawn.secrets, "SystemRandom", Draws)
        assert free_port() == spare


def test_spawn_rejects_bad_nproc():
    with pytest.raises(ValueError, match="nproc"):
        collectives.spawn(_identity, 0)


def test_spawn_passes_backend_to_init_process_group():
    results = collectives.spawn(_world_of, 2, args=("shm",), backend="shm")
    assert results == [("shm", 0, 2, [3.0] * 3), ("shm", 1, 2, [3.0] * 3)]


def _tensor_and_threads():
    import torch
    return torch.arange(3) * int(os.environ["RANK"]), torch.get_num_threads()


def test_spawn_returns_tensors_and_ranks_start_with_one_thread(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    results = collectives.spawn(_tensor_and_threads, 2)
    assert [r[0].tolist() for r in results] == [[0, 0, 0], [0, 1, 2]]
    assert [r[1] for r in results] == [1, 1]


def test_mpich_hydra_without_job_variables_still_gets_a_job_id():
    r = detect_rendezvous(env={"PMI_RANK": "0", "PMI_SIZE": "2", "PMI_FD": "5"})
    assert r.job_id and r.job_id.startswith("mpi-ppid=")
