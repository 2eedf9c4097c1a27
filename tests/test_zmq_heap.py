"""The zmq backend's malloc thresholds (``backends.zeromq.heap``): libzmq's receive buffers
are reused from the heap instead of faulted in afresh on every large message, and the
process can say no (``COLLECTIVES_ZMQ_MALLOC=system``) or have chosen its own thresholds."""

from __future__ import annotations

import os
import resource
import subprocess
import sys

import pytest

import collectives

zmq = pytest.importorskip("zmq")

from backends.zeromq import heap  # noqa: E402

GLIBC = heap.is_glibc()

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LARGE = 16 << 20  # bytes: four frames of wire.FRAME_MAX per direction and phase


def _job_faults_per_large_all_reduce():
    import numpy as np
    pg = collectives.init_process_group()
    a = np.zeros(LARGE // 4, np.float32)
    for _ in range(3):  # the heap grows to its working size
        pg.all_reduce(a)
    per_call = []
    for _ in range(10):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        pg.all_reduce(a)
        per_call.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    malloc = pg.transport.malloc
    pg.close()
    return malloc, per_call


CHOSEN_HERE = heap._user_chose(os.environ) or "COLLECTIVES_ZMQ_MALLOC" in os.environ


@pytest.mark.skipif(not GLIBC, reason="the thresholds are glibc's")
@pytest.mark.skipif(CHOSEN_HERE, reason="this environment chose malloc's settings itself")
def test_large_messages_reuse_received_buffers_instead_of_faulting_pages_in():
    # Each call receives 16 MiB per rank (8 MiB of reduce-scatter, 8 of all-gather):
    # 4096 pages. With glibc's own thresholds 270 to 1800 of them faulted in per call
    # here (the mean of ten; the median of ten on the rank that faults: about 1000);
    # kept, a mean of 0 to 70. Judged by the eighth of ten calls in order of faults: one
    # or two calls that meet a heap trim or a busy neighbour (under a full suite's
    # load the mean of ten once reached 206) say nothing about the buffers being reused.
    for malloc, per_call in collectives.spawn(_job_faults_per_large_all_reduce, 2,
                                              backend="zmq", timeout=120):
        assert malloc == "kept"
        assert sorted(per_call)[7] < 160, f"page faults per 16 MiB all_reduce: {per_call}"


def _job_malloc_mode():
    pg = collectives.init_process_group()
    malloc = pg.transport.malloc
    pg.close()
    return malloc


def test_a_process_can_keep_glibc_s_own_thresholds():
    env = {"COLLECTIVES_ZMQ_MALLOC": "system"}
    assert collectives.spawn(_job_malloc_mode, 2, backend="zmq", timeout=60,
                             env=env) == ["system", "system"]


def test_a_world_of_one_receives_nothing_and_sets_nothing():
    assert collectives.spawn(_job_malloc_mode, 1, backend="zmq", timeout=60) == ["unused"]


@pytest.mark.parametrize("variable, value", [
    ("MALLOC_TRIM_THRESHOLD_", "1048576"),
    ("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=262144"),
    ("LD_PRELOAD", "/nowhere/libjemalloc.so.2"),  # ld.so warns and goes on without it
])
@pytest.mark.skipif(not GLIBC, reason="the thresholds are glibc's")
def test_thresholds_the_process_chose_itself_are_left_alone(variable, value):
    code = "from backends.zeromq import heap; print(heap.keep_receive_buffers())"
    env = dict(os.environ, PYTHONPATH=ROOT, **{variable: value})
    env.pop("COLLECTIVES_ZMQ_MALLOC", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=60, check=True).stdout.split()
    assert out == ["user"]


def test_a_bad_choice_is_a_value_error_naming_the_variable():
    with pytest.raises(ValueError, match="COLLECTIVES_ZMQ_MALLOC='mmap'.*keep, system"):
        heap.keep_receive_buffers({"COLLECTIVES_ZMQ_MALLOC": "mmap"})
