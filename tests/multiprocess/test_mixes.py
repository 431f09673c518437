"""2D mixes and a 4-stage pipeline at world 4 (the farm's ranks): FSDP×TP, DDP×TP(+SP), PP×DP, PP×TP, PP(4), DP×EP,
and zero1×TP(+SP) with the vocab-parallel loss (issue 34: torch's loss_parallel)."""

import pytest

from tests.helpers.farm import assert_parity, params, parity_job
from tests.helpers.specs import tiny

PARITY = {s.name: parity_job(s) for s in [
    tiny("fsdp_x_tp", strategy="fsdp", world_size=4, tp=2),
    tiny("ddp_x_tp_sp", strategy="ddp", world_size=4, tp=2, sequence_parallel=True,
         train={"optimizer": "sgd", "lr": 0.5}),
    tiny("pp_x_dp", strategy="ddp", world_size=4, pp=2),
    tiny("pp_x_tp", strategy="pp", world_size=4, pp=2, tp=2, pp_schedule="gpipe", train={"global_batch": 4}),
    tiny("pp4_1f1b", model={"n_layers": 4}, strategy="pp", world_size=4),
    tiny("dp4_x_ep2", model={"n_experts": 4, "top_k": 2}, strategy="ep", world_size=4, ep=2,
         train={"optimizer": "sgd", "lr": 0.5}),
    tiny("zero1_x_tp_sp_loss_parallel", strategy="zero1", world_size=4, tp=2, sequence_parallel=True,
         train={"loss_parallel": True}),
]}


@pytest.mark.slow
@pytest.mark.parametrize("name", params(PARITY))
def test_mix_parity(farm, name):
    assert_parity(farm.result(PARITY[name]))
