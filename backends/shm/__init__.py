"""The ``shm`` backend: collectives through POSIX shared memory between the processes of
one host. Registered as ``shm`` (``backends.shm:create``); the default backend outside
MPI launchers.

How it works, module by module:

- ``segment``: one file per group in /dev/shm, found through the job id alone (no
  sockets). The leader creates it under a temporary name and publishes it with
  ``os.link``; everyone maps it and marks itself attached; the name is unlinked as soon as
  all are attached, so nothing is left in /dev/shm even after a SIGKILL.
- ``futex``: waiting. Spin, ``sched_yield`` for a while (how long: ``native.wait_policy``,
  by the cores per rank), then sleep in the kernel on this rank's doorbell word
  (FUTEX_WAIT, in slices of at most 200 ms, so deadlines and peer liveness are
  checked); ``COLLECTIVES_SHM_WAIT=sleep`` replaces the futex with sleeps growing to 1 ms.
- ``codes`` and ``phases``: the protocol, phases over two banks of per-rank slots (no
  atomics: every shared word has one writer), fingerprints that catch mismatched calls,
  and every wait and error.
- ``core`` and ``native_core``: the two paths, one interface: numpy over the segment
  (``PythonCore``) and the compiled core (``NativeCore``, over ``_native.c``, built by
  the package's own build where a C compiler is present). They speak the same protocol
  (same layout, phases, fingerprints, doorbells, rings); the compiled one takes over the
  hot loops: publishing and waiting for a phase (C11 release/acquire, spin then
  ``sched_yield`` then FUTEX_WAIT, the GIL released), the one-phase collectives, the
  rank-order reductions of every dtype, and whole point-to-point messages when nothing
  else is queued on their ring. Python keeps every error. Without it, or with
  ``COLLECTIVES_SHM_NATIVE=0``, the Python path runs (a warning says so once when the
  core is missing); ``pg.transport.native`` tells which.
- ``moves`` and ``reduce``: the collectives as loops over phases, for any size: messages
  larger than a slot are chunked, so any size runs in a fixed footprint; all_reduce above
  32 KiB is a reduce-scatter + all-gather pipelined one chunk per phase. Reductions
  combine inputs in rank order: bitwise-identical results on every rank.
- ``cma`` and ``symmetric``: the large all_reduce in place, reading the peers' arrays
  through the kernel (single copy) or their symmetric buffers.
- ``channels``: point to point, one byte ring per ordered pair of ranks, MPI-style tag
  matching with an unexpected-message queue.
- ``backend``: ``ShmBackend`` itself, made of the parts above (paths, sub-groups,
  lifetime, abort).
- ``placement``: one core per rank when the ranks outnumber the cores
  (``pg.transport.bound_core``).

Shared memory per group of n ranks: 2 x n x S bytes of data banks (S =
``COLLECTIVES_SHM_CHUNK_BYTES``, default 1 MiB: 8 MiB for 4 ranks, whatever the message
size) plus n x (n-1) rings of R bytes that point to point touches as it uses them
(``COLLECTIVES_SHM_RING_BYTES``, default 1 MiB shrinking to 64 KiB as n grows). The file is
sparse: pages count once written.

Environment: ``COLLECTIVES_SHM_CHUNK_BYTES`` and ``COLLECTIVES_SHM_RING_BYTES`` are read by
the group's leader (the others follow its header); per process ``COLLECTIVES_SHM_WAIT``
(``futex``/``sleep``), ``COLLECTIVES_SHM_SPIN_US`` and ``COLLECTIVES_SHM_YIELD_US``
(defaults from ``native.wait_policy``: 50 and 1000 with a core per rank, 0 and 50
with more ranks than cores), ``COLLECTIVES_SHM_BIND`` (``auto``: the world group binds
each rank to one core when the ranks outnumber the cores, ``core``, ``none``; see
``placement``), ``COLLECTIVES_SHM_PID_CHECK`` (``0``: no pid liveness
checks), ``COLLECTIVES_SHM_NATIVE`` (``0``: the Python path).

Limits: one host. On the compiled core the phases of every collective, and the messages
it moves whole, are published with release stores and read with acquire loads, so that
part holds on any architecture with C11 atomics (tested on x86-64 only); the Python path,
and the point-to-point engine's Python loop (a message larger than the ring's free
space, or queued behind another), still rely on x86-64's ordering (TSO). After an error
in a collective (mismatch, timeout, dead peer) the group is broken: close it.
"""

from __future__ import annotations

from collectives.launch import Rendezvous

from . import placement
from .backend import ShmBackend

__all__ = ["ShmBackend", "create"]


def create(rendezvous: Rendezvous, timeout: float, *, group: str = "world") -> ShmBackend:
    """Connect this rank to the world of ``rendezvous`` through /dev/shm. ``group`` names
    the segment within the job (the hier backend gives each host's ranks a name of their
    own, so that virtual hosts on one machine stay apart)."""
    size = rendezvous.world_size
    if size > 1 and rendezvous.local_world_size != size:
        raise ValueError(
            f"the shm backend connects the processes of one host, but this world has "
            f"{size} ranks of which {rendezvous.local_world_size} are local; use a "
            f"network backend (zmq, mpi, gloo) across hosts")
    # Placed first, so that the wait policy sees where the rank will run.
    place = placement.Placement(rendezvous.rank, size)
    try:
        # A re-formed group (collectives.regroup) meets in a segment of its generation,
        # named under the same job so that the launcher's clean-up finds it too.
        key = group if not rendezvous.generation else f"{group}.gen{rendezvous.generation}"
        return ShmBackend.open(rendezvous.job_id, key, rendezvous.rank, size, timeout,
                               tuple(range(size)), place)
    except BaseException:
        place.release()
        raise
