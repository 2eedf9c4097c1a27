"""The names of shared-memory segments, shared by the shm backend and the launcher.

Every segment this library creates is ``/dev/shm/collectives-<job>-<group>``: the fixed
prefix ``collectives-`` (documented, so an operator can find leftovers), a digest of the
job id (so a launcher can remove its own job's segments and no other's) and the group.
The shm backend unlinks a segment as soon as every rank has mapped it, so normally
nothing is visible there even while a job runs; the launcher removes what a rank killed
during set-up left behind.
"""

from __future__ import annotations

import hashlib
import os

from . import settings

PREFIX = "collectives-"
SHM_DIR = "/dev/shm"


def job_digest(job_id: str) -> str:
    """A short, filename-safe digest of a job id."""
    return hashlib.sha256(job_id.encode()).hexdigest()[:16]


def segment_name(job_id: str, group: str) -> str:
    """The segment (file name under /dev/shm) of ``group`` in job ``job_id``."""
    return f"{PREFIX}{job_digest(job_id)}-{group}"


def remove_job_segments(job_id: str) -> list[str]:
    """Remove every segment of job ``job_id`` (as named by :func:`segment_name` with the
    spawn launcher's job id, ``COLLECTIVES_JOB_ID=<id>``); return the names removed."""
    removed = []
    for key in (job_id, f"{settings.JOB_ID.name}={job_id}"):
        stem = f"{PREFIX}{job_digest(key)}-"
        try:
            names = os.listdir(SHM_DIR)
        except FileNotFoundError:
            return removed
        for name in names:
            if name.startswith(stem):
                try:
                    os.unlink(os.path.join(SHM_DIR, name))
                    removed.append(name)
                except FileNotFoundError:
                    pass
    return removed
