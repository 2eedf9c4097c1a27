"""Fully sharded data parallelism (ZeRO stages 1-3), unit by unit.

- :mod:`.flat_param`: a unit's parameters as one flat vector, padded, sharded, viewed.
- :mod:`.unit`: gathering, freeing and reducing one unit.
- :mod:`.prefetch`: what to gather next, and the order every rank keeps.
- :mod:`.wrap`: which submodules become units.
- :mod:`.api`: :class:`FullyShardedDataParallel` (``FSDP``), the hooks that drive it.
- :mod:`.state_dict`, :mod:`.checkpoint`: full state dicts, resharding checkpoints.
- :mod:`.memory`: bytes held per category.
"""

from .api import FSDP, FullyShardedDataParallel
from .flat_param import shard_layout

__all__ = ["FSDP", "FullyShardedDataParallel", "shard_layout"]
