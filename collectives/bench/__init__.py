"""nccl-tests style microbenchmarks of the collectives, with the raw peer libraries
(mpi4py, torch.distributed gloo) side by side: ``python -m collectives.bench --help``.

- :mod:`~collectives.bench.cases`: buffers, sizes, busbw factors and the correctness check
  of each op (pure numpy);
- :mod:`~collectives.bench.measure`: the timing loop and our ProcessGroup under it;
- :mod:`~collectives.bench.peers`: the same ops through raw mpi4py and torch.distributed;
- :mod:`~collectives.bench.job`: starting the ranks (``collectives.spawn`` or ``mpiexec``);
- :mod:`~collectives.bench.report`, :mod:`~collectives.bench.plot`: the table, JSON and
  the figure.

The same loop from Python, two ranks over shared memory::

    from collectives.bench.job import JobSpec, run_spawned
    rows, _ = run_spawned(JobSpec(impls=["shm"], ops=["all_reduce"], sizes=[4, 1 << 20]),
                          nproc=2, job_timeout=120)
    [(r["bytes"], r["time_us"], r["wrong"]) for r in rows]
"""

from .cases import OPS, busbw_factor, make_case

__all__ = ["OPS", "busbw_factor", "make_case"]
