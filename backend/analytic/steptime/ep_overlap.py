"""Expert-parallel all-to-alls hidden by Megatron-Core's combined 1F1B schedule (--overlap-moe-expert-parallel-comm,
the stack setting `ep_overlap`), per stage and microbatch (pure Python).

Read from Megatron-LM d98e8a64:
- model_chunk_schedule_plan.py 236-303 (`TransformerLayerSchedulePlan.run`): in a steady-state step one microbatch's
  forward and another's backward run layer by layer, the dispatch and combine all-to-alls on the communication stream
  beside the attention (pre-dispatch) and MLP computation on the compute stream;
- schedules.py 955-971 (`get_pp_rank_microbatches`): with pipelining, pp rank k runs (pp - k - 1) 2 + (v - 1) g
  warmup chunks (g = microbatch_group_size_per_vp_stage, pp by default) plus one more forward under the overlap; the
  same number of backward chunks cools down alone; combined_1f1b.py 51-64 without pipelining: the first forward and
  the last backward alone.
The model hides, in each steady-state step, the pair's all-to-alls behind the pair's compute, up to that compute. It
does not split the step's three phases (combine backward beside the attention forward, the dispatches beside the MLPs,
combine forward beside the attention backward): where one phase's all-to-all outlasts its computation, what the model
hides is an upper bound.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from backend.spec import ParallelSpec


def steady_fraction(parallel: ParallelSpec, microbatches: int, pp_rank: int) -> float:
    """The share of a pp rank's forward (and backward) chunks that run inside a combined 1F1B step."""
    v = parallel.virtual_stages
    chunks = microbatches * v
    warmup = 1 if parallel.pp == 1 else (parallel.pp - pp_rank - 1) * 2 + (v - 1) * parallel.pp + 1
    return (chunks - min(warmup, chunks)) / chunks


def hidden_ep_s(ep_s: float, compute_s: float, steady: float) -> float:
    """A stage's EP seconds per microbatch (forward + backward all-to-alls) hidden behind compute_s, the stage's
    forward + backward computation of one microbatch, over the steady share of its chunks."""
    return steady * min(ep_s, compute_s)
