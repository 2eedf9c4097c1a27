"""The backend hook contract: what :class:`~collectives.group.ProcessGroup` hands a
backend's hooks, and what it expects back. Written here once; every backend and every
algorithm of :mod:`collectives.algorithms` keeps it.

Transport hooks (every backend implements the first three)
    ``_isend(array, dst, tag) -> Work`` and ``_irecv(array, src, tag) -> Work`` start a
    send or a receive of one array to or from group rank ``dst``/``src`` and return a
    :class:`~collectives.work.Work` whose ``wait(timeout=None)`` blocks until the array
    may be reused (send) or holds the message (receive), at most the group's timeout
    when ``timeout`` is None. Messages between one pair with one tag arrive in order; a
    send completes even if the receive is posted later. Tags are ints in ``[0, 2**63)``:
    user tags below ``2**31``, the library's own above (``collectives.algorithms.links``).
    ``_barrier(seq) -> None`` returns once every rank entered barrier ``seq``.
    ``_send_now(array, dst, tag) -> None`` and ``_recv_now(array, src, tag) -> None``
    (optional; the defaults are ``_isend(...).wait()`` and ``_irecv(...).wait()``) are the
    blocking ``send`` and ``recv`` of the fast path (:mod:`collectives.fast_path`), used
    only where that path is (no ``COLLECTIVES_DEBUG``, no ``hooks_return_work``, the
    default ``_to_host``). ``array`` is the caller's own memory: a flat, C-contiguous
    numpy view of a supported dtype (writable for a receive), never staged; ``dst``/
    ``src`` a peer (not this rank); ``tag`` a user tag. On return they guarantee what
    the waited Work does, and they keep its rules: messages of one (peer, tag) stay in
    order with those of ``_isend``/``_irecv`` (a ``_recv_now`` never takes a message an
    earlier receive or the set-aside queue should get), every wait is bounded by
    ``self.timeout``, errors are typed and name the op, the peer and the tag, a closed
    group raises ``CollectiveError``, and several threads of one rank may call them
    and ``_isend``/``_irecv`` at once. A backend overrides them where one call can do
    what a posted operation and its wait do (shm: one C call moves the message when its
    ring is free).

Collective hooks (optional: the defaults run :mod:`collectives.algorithms` over the
transport hooks)
    ``_broadcast(a, src, seq)``, ``_all_reduce(a, op, seq)``, ``_reduce(a, dst, op, seq)``,
    ``_all_gather(out, inp, seq)``, ``_gather(inp, out, dst, seq)`` (``out`` None off
    ``dst``), ``_scatter(out, inp, src, seq)`` (``inp`` None off ``src``),
    ``_reduce_scatter(out, inp, op, seq)``, ``_all_to_all(out, inp, out_counts,
    in_counts, seq)`` (element counts per peer, this rank's own only).

What a hook receives
    - **Flat, C-contiguous** buffers: 1-D, whatever the caller's shape (a 0-d tensor
      arrives as one element), one per tensor argument. They are what the group's
      ``_to_host`` returned for that argument. By default (:func:`collectives.buffers.to_host`)
      that is a host ``numpy.ndarray`` (``bfloat16`` as ``ml_dtypes.bfloat16``): a
      zero-copy view of the caller's contiguous CPU tensor or array, or a staged copy
      (non-contiguous views, CUDA tensors, read-only inputs) that the base class writes
      back after the hook returned. A backend whose library takes tensors declares so by
      overriding ``_to_host``; its hooks then receive those (the torch backends: CPU
      torch tensors as they are, CUDA tensors for NCCL).
    - Arguments already checked on this rank: ranks in range, dtypes equal, sizes
      consistent (``out`` holds ``size x inp`` and so on), the reduction valid for the
      dtype (:func:`collectives.reduce_op.check_reducible`). Whether the *other* ranks
      made the same call is checked only with ``COLLECTIVES_DEBUG=1``
      (:mod:`collectives.call_check`) or by the backend itself.
    - ``seq``: the collective's number, the same on every rank; it names the call in
      errors and keeps the tags of concurrent collectives apart (``Links(group, seq)``).
    - Reductions combine through :func:`collectives.reduce_op.combine_into` and
      :func:`collectives.reduce_op.finish` (AVG divides once, at the end), in an order
      that is the same on every rank, so all_reduce results are bitwise identical.

What a hook returns
    Either ``None``, once the operation is complete on this rank (outputs written): the
    hook may block. It runs on the calling thread, or on the group's own thread for
    ``async_op=True`` (one thread, so operations keep their issue order on every rank):
    a hook must not assume which. Every wait inside it is bounded by ``self.timeout``.

    Or, in a backend that sets ``hooks_return_work = True`` (MPI's and torch's
    non-blocking calls), a :class:`~collectives.work.Work` for the operation it *started*
    without blocking. The base class then calls the hook on the calling thread also for
    ``async_op=True`` (``_before_start(async_op)`` runs first), and either waits on the
    Work at once or hands it to the caller (tracked with ``_track`` until it finished, so
    that ``close()`` can finish it). ``Work.wait(None)`` must bound its wait by the group's
    timeout. Exceptions the hook raises go through ``self._translate(exc, op, seq)``.

    Either way, failures are typed: :class:`~collectives.errors.CollectiveTimeout` for a
    wait that ran out, :class:`~collectives.errors.PeerError` for a peer that died or
    closed, :class:`~collectives.errors.CollectiveMismatch` for calls that do not match;
    each names the op, ``seq`` and the rank (``self._describe(op, seq)``). No backend
    overrides ``ProcessGroup._run``.

Two ranks, a hook of a backend that adds 1 after the default all_reduce::

    class Mine(SomeBackendGroup):
        def _all_reduce(self, a, op, seq):        # a: flat float32 numpy array
            super()._all_reduce(a, op, seq)       # complete on return
            a += 1
"""
