"""One task of a (real or simulated) srun step: join the world, all_reduce the ranks.

    srun -n 2 python tests/scripts/slurm_task.py --backend zmq

Every task prints one JSON line: ``{"rank", "world_size", "local_rank",
"local_world_size", "launcher", "master", "sum"}`` where ``sum`` is the all_reduce of
``rank + 1`` over the world (``n (n + 1) / 2`` when the tasks formed one world).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import collectives  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default=None)
    args = parser.parse_args()
    where = collectives.detect_rendezvous()
    with collectives.init_process_group(args.backend, timeout=60) as pg:
        value = np.array([pg.rank + 1.0])
        pg.all_reduce(value)
        pg.barrier()
        print(json.dumps({"rank": pg.rank, "world_size": pg.size,
                          "local_rank": where.local_rank,
                          "local_world_size": where.local_world_size,
                          "launcher": where.launcher,
                          "master": f"{where.master_addr}:{where.master_port}",
                          "sum": float(value[0])}), flush=True)


if __name__ == "__main__":
    main()
