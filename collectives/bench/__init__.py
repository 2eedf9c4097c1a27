"""nccl-tests style microbenchmarks of the collectives, with the raw peer libraries
(mpi4py, torch.distributed gloo) side by side: ``python -m collectives.bench --help``.

- :mod:`~collectives.bench.cases`: buffers, sizes, busbw factors and the correctness check
  of each op (pure numpy);
- :mod:`~collectives.bench.measure`: the timing loop and our ProcessGroup under it;
- :mod:`~collectives.bench.peers`: the same ops through raw mpi4py and torch.distributed;
- :mod:`~collectives.bench.job`: starting the ranks (``collectives.spawn`` or ``mpiexec``);
- :mod:`~collectives.bench.report`, :mod:`~collectives.bench.plot`: the table, JSON and
  the figure.

The contract (what every row means, whatever runs it)::

    python -m collectives.bench --backend B --nproc N --ops all_reduce,all_gather,...
                                --sizes 4,4096,...,67108864 [--peer mpi4py|torch-gloo]
                                [--json FILE]

prints a table in the nccl-tests convention (bytes, count, dtype, time_us, algbw GB/s,
busbw GB/s, busbw = algbw x the op's factor: all_reduce 2(n-1)/n, all_gather and
reduce_scatter (n-1)/n, broadcast 1, all_to_all (n-1)/n); with ``--peer`` it runs the
same sizes through the raw peer library in the same run and prints the ratio. ``--json
FILE`` writes a list of rows ``{"impl": backend or peer name, "op", "world_size",
"bytes", "dtype", "time_us", "algbw_gbps", "busbw_gbps", "wrong"}`` (time: the median
over timed iterations of the slowest rank), plus extra fields.

The same loop from Python, two ranks over shared memory::

    from collectives.bench.job import JobSpec, run_spawned
    rows, _ = run_spawned(JobSpec(impls=["shm"], ops=["all_reduce"], sizes=[4, 1 << 20]),
                          nproc=2, job_timeout=120)
    [(r["bytes"], r["time_us"], r["wrong"]) for r in rows]
"""

from .cases import OPS, busbw_factor, make_case

__all__ = ["OPS", "busbw_factor", "make_case"]
