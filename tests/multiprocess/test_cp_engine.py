"""Context parallelism through the engine's parallelize(): loss and final parameters equal the single-process
reference at world 2 (cp alone, both K/V rotations and chunk layouts) and at world 4 (cp alone, cp x fsdp, cp x tp
with SP, cp x pp, cp x ep), one launch per world. A CUDA rank's set-up by construction: tests/unit/test_cp_engine.py."""

import pytest

from tests.helpers.mp_launch import assert_parity, run_specs, tiny

FLASH = {"attention": "flash"}
WORLD2 = [
    tiny("cp2", model=FLASH, world_size=2, cp=2),
    tiny("cp2_alltoall_contiguous_rope", model=FLASH | {"positions": "rope", "norm": "rmsnorm", "mlp": "swiglu"},
         world_size=2, cp=2, cp_rotate="alltoall", cp_load_balance=False),
]
WORLD4 = [
    tiny("cp4", model=FLASH, world_size=4, cp=4),
    tiny("cp2_x_fsdp2", model=FLASH, strategy="fsdp", world_size=4, cp=2),
    tiny("cp2_x_tp2_sp", model=FLASH, strategy="tp", world_size=4, cp=2, tp=2, sequence_parallel=True),
    tiny("cp2_x_pp2", model=FLASH, world_size=4, cp=2, pp=2),
    tiny("cp2_x_ep2", model=FLASH | {"n_experts": 4, "top_k": 2}, strategy="ep", world_size=4, cp=2, ep=2,
         train={"optimizer": "sgd", "lr": 0.5}),
]


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return run_specs(2, WORLD2, tmp_path_factory.mktemp("cp2"), timeout_s=300)


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    return run_specs(4, WORLD4, tmp_path_factory.mktemp("cp4"), timeout_s=500)


@pytest.mark.slow
@pytest.mark.parametrize("name", [s.name for s in WORLD2])
def test_cp_parity_world2(world2, name):
    assert_parity(world2[name])
    assert any(n.startswith("CP: each sequence split over cp=2") for n in world2[name]["notes"])


@pytest.mark.slow
@pytest.mark.parametrize("name", [s.name for s in WORLD4])
def test_cp_parity_world4(world4, name):
    assert_parity(world4[name])
