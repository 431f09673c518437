"""Megatron's distributed optimizer (zero1 on the dp dimension of a tp / pp mix) as the engine runs it
(backend/strategies/distributed_optimizer.py), pure Python + numpy, scalars or arrays of layouts.

Buckets: per stage module one for the embeddings, one per transformer block, one for the head (final norm +
lm_head); each holds its local (tp-sharded) parameters contiguously, padded to a multiple of dp. Per bucket of n
padded elements a rank keeps: the param buffer (n x 2 B under bf16/fp16-mixed, whose module runs in that dtype
without autocast; 4 B in fp32), the fp32 main-grad buffer (4n), and for its slice of n/dp elements the fp32 master
(16-bit params only) and the optimizer state (AdamW m, v + one `step`; SGD momentum). Without padding that is
Megatron's 6 + 12/dp bytes per parameter (fp32: 8 + 8/dp; Korthikanti et al. 2022 / Megatron-LM
docs/source/api-guide/dist_optimizer.md table). Bucket rules: dp_buckets.py; traffic: traffic.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from backend.analytic.device import CUDA, CUDA_MIN_BLOCK_BYTES, adamw_step_on_device
from backend.analytic.dp_buckets import padded
from backend.analytic.expert_layout import ExpertLayout
from backend.analytic.optimizer_state import STEP_TENSOR_BYTES
from backend.analytic.scalar_or_array import ceil_div, where
from backend.analytic.traffic import MASTER_BYTES

if TYPE_CHECKING:
    from backend.analytic.layout import Layout
    from backend.analytic.memory.parts import RankParts
    from backend.analytic.scalar_or_array import Num


def param_bytes(layout: Layout) -> Num:
    """Bytes per parameter element: the 16-bit compute dtype under mixed precision, else fp32."""
    return where(layout.half_params, layout.compute_bytes, MASTER_BYTES)


def _storage(nbytes: Num, cuda: bool) -> Num:
    return ceil_div(nbytes, CUDA_MIN_BLOCK_BYTES) * CUDA_MIN_BLOCK_BYTES if cuda else nbytes


def model_state_bytes(layout: Layout, parts: RankParts) -> tuple[Num, Num, Num]:
    """(params, grads, optimizer) bytes of a rank: sums over its buckets ((n_blocks - n_alt) x block + n_alt x the
    other MLP kind's block (mixed stacks: DeepSeek's dense prefix, Llama 4's interleave) + first x embeddings +
    last x head), each padded to a multiple of dp; on CUDA every buffer is its own 512-B-rounded storage. Under
    ep > 1 a MoE block's routed experts are a bucket of their own (Megatron's expert buffer), padded to a multiple
    of edp = dp x cp / ep and sharded over it: 2 + 4 + 12 / edp bytes per expert element in bf16 (moe.md Sec 2.4,
    Megatron's theoretical_memory_usage.compute_weight_and_optimizer_memory)."""
    cuda, dp, s = layout.device == CUDA, layout.dp, parts.stages
    edp = ExpertLayout.of(layout.tp, layout.dp_cp, layout.ep, layout.etp).edp
    half = layout.half_params
    pb = param_bytes(layout)
    state_tensors = 2 if layout.optimizer == "adamw" else 1
    totals = [0, 0, 0]
    buckets = ((s.n_blocks - s.n_alt, parts.block), (s.n_alt, parts.alt_block), (s.first, parts.embeddings),
               (s.last, parts.head))
    for count, part in buckets:
        experts = part.ep_expert_numel
        for numel, group, holds in ((part.local_numel - experts, dp, part.tensors > 0), (experts, edp, experts > 0)):
            n = padded(numel, group)
            shard = n / group if isinstance(n, np.ndarray) and n.dtype.kind == "f" else n // group  # exact: padded
            master = where(half, _storage(MASTER_BYTES * shard, cuda), 0)
            step = (STEP_TENSOR_BYTES * holds if layout.optimizer == "adamw" and adamw_step_on_device(layout.device)
                    else 0)
            optimizer = master + state_tensors * _storage(MASTER_BYTES * shard, cuda) + step
            for i, value in enumerate((_storage(pb * n, cuda), _storage(MASTER_BYTES * n, cuda), optimizer)):
                totals[i] = totals[i] + count * value
    return totals[0], totals[1], totals[2]
