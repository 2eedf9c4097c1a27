"""Expert parallelism: a mixture-of-experts layer whose experts live on different ranks,
tokens moved by ``all_to_all`` with uneven split sizes.

Each rank holds E/P of the E experts and routes its own tokens; a token's rows travel to
the ranks of its chosen experts and the experts' outputs travel back (torchtitan's expert
parallel, Megatron-Core's token dispatchers, DeepEP's dispatch/combine). Two ranks, eight
experts::

    router = nn.Linear(64, 8, bias=False)                  # replicated
    moe = MoE(router, [Expert() for _ in range(4)], pg, top_k=2, capacity_factor=1.25)
    y = moe(x)                                             # (T_r, 64): this rank's tokens
    loss = F.cross_entropy(head(y), target) + 0.01 * moe.aux_loss

- :mod:`.gating`: top-k gates, the capacity limit, the load-balancing loss (no
  communication).
- :mod:`.exchange`: the counts, the differentiable exchange of rows, the expert-major
  order.
- :mod:`.moe`: :class:`MoE`.
- :mod:`.data_parallel`: experts sharded over ``ep``, the rest replicated by DDP or FSDP
  (:func:`replicate_outside_experts`, :func:`average_expert_grads`).
"""

from .data_parallel import average_expert_grads, expert_parameters, replicate_outside_experts
from .exchange import ExchangeRows, exchange_counts, exchange_rows, expert_major
from .gating import capacity_of, load_balancing_loss, top_k_gates, within_capacity
from .moe import MoE

__all__ = ["ExchangeRows", "MoE", "average_expert_grads", "capacity_of", "exchange_counts",
           "exchange_rows", "expert_major", "expert_parameters", "load_balancing_loss",
           "replicate_outside_experts", "top_k_gates", "within_capacity"]
