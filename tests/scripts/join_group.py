"""A fresh process that joins survivors (``tests/test_regroup.py``): run with the job's
environment; ``python join_group.py RANK WORLD_SIZE GENERATION`` prints one JSON line,
what :func:`faults.regroup_tasks.check_collectives` saw on the joined group."""

import json
import sys

import collectives
from faults.regroup_tasks import check_collectives

rank, world_size, generation = (int(a) for a in sys.argv[1:4])
group = collectives.join_group(rank=rank, world_size=world_size, generation=generation)
try:
    print(json.dumps(check_collectives(group)))
finally:
    group.close()
