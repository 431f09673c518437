"""Issue 23: the prediction core takes one layout (Python scalars) or arrays of layouts through the same code.
Every memory category of every pipeline rank agrees between the array call and the scalar call, on CPU and CUDA
storage rules; the scalar-or-array helpers (analytic/scalar_or_array.py) and the named Layout behave alike on both."""

from __future__ import annotations

import random

import numpy as np
import pytest

from backend.analytic.layout import CHOICES, Layout, RankPosition, ZeroStage
from backend.analytic.memory.rank_memory import rank_memory, worst_rank_memory
from backend.analytic.scalar_or_array import maximum, per_distinct, per_value, select, where
from backend.planner.space import enumerate_layouts, light_spec
from backend.spec import ExperimentSpec, ModelSpec

MOE = ModelSpec(vocab_size=320, d_model=64, n_layers=6, n_heads=4, n_kv_heads=2, ffn_hidden=96, seq_len=32, n_experts=4,
                top_k=2, n_shared_experts=1, norm="rmsnorm", mlp="swiglu", positions="rope", bias="none")
ODD = ModelSpec(vocab_size=251, d_model=96, n_layers=7, n_heads=6, seq_len=30, ffn_hidden=333, tie_embeddings=True)
CATEGORIES = ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "other_bytes", "total_bytes")


@pytest.mark.parametrize("model,gpus,batch,precision", [(MOE, 16, 32, "bf16-mixed"), (ODD, 12, 24, "fp32")])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_array_and_scalar_calls_agree_on_every_category_and_pipeline_rank(model, gpus, batch, precision, device):
    layouts = enumerate_layouts(model, gpus=gpus, gpus_per_node=4, global_batch=batch, precision=precision)
    layouts = Layout(**{**{f: getattr(layouts, f) for f in CHOICES}, "microbatches": layouts.microbatches,
                        "global_batch": batch, "precision": precision, "optimizer": "adamw", "device": device})
    rows = sorted(random.Random(23).sample(range(len(layouts)), 60))
    for pp in sorted({int(layouts.pp[i]) for i in rows}):
        group = np.array([i for i in rows if layouts.pp[i] == pp])
        table = rank_memory(model, layouts.take(group).broadcast(),
                            RankPosition(pp_rank=np.arange(pp)[None, :], largest_zero1_share=True))
        for k, i in enumerate(group.tolist()):
            one = layouts.take(i)
            for rank in range(pp):
                scalar = rank_memory(model, one, RankPosition(pp_rank=rank, largest_zero1_share=True))
                for c in CATEGORIES:
                    value = getattr(scalar, c)
                    assert isinstance(value, int), (c, type(value))
                    assert (np.broadcast_to(getattr(table, c), np.shape(table.total_bytes))[k, rank]
                            == value), (i, rank, c)
    assert {int(z) for z in layouts.zero_stage[rows]} == set(ZeroStage.ALL)


def test_worst_rank_of_one_layout_equals_its_row_in_the_table():
    layouts = enumerate_layouts(ODD, gpus=12, gpus_per_node=4, global_batch=24)
    table, at = worst_rank_memory(ODD, layouts)
    for i in range(0, len(layouts), 41):
        assert worst_rank_memory(ODD, layouts.take(i)) == (table[i], at[i])


def test_layout_of_a_spec_round_trips_through_the_planners_spec_dict():
    layouts = enumerate_layouts(MOE, gpus=16, gpus_per_node=4, global_batch=32)
    for i in range(0, len(layouts), 97):
        one = layouts.take(i)
        assert Layout.of(light_spec(one.spec_dict(MOE))) == one
        spec = ExperimentSpec.for_prediction(one.spec_dict(MOE))
        assert Layout.of(spec) == one


def test_vector_helpers_give_scalars_for_scalars_and_arrays_for_arrays():
    a = np.array([0, 1, 2, 3])
    assert where(True, 1, 2) == 1 and where(np.array([True, False]), 1, 2).tolist() == [1, 2]
    assert maximum(3, 5) == 5 and maximum(a, 2).tolist() == [2, 2, 2, 3]
    assert select(2, ["a", "b", "c"]) == "c"
    assert select(np.array([2, 0, 1]), [np.array([10, 10, 10]), 20, 30]).tolist() == [30, 10, 20]
    calls = []

    def f(x, y):
        calls.append((x, y))
        return x * 10 + y

    assert per_distinct(f, 3, 4) == 34
    calls.clear()
    out = per_distinct(f, np.array([[1], [2], [1]]), np.array([[0, 5]]))
    assert out.tolist() == [[10, 15], [20, 25], [10, 15]] and len(calls) == 4  # once per distinct row
    layouts = enumerate_layouts(ODD, gpus=12, gpus_per_node=4, global_batch=24)
    split = per_value(layouts.fsdp, lambda lay, fsdp: np.full(len(lay), 1.0 if fsdp else 2.0), layouts)
    assert split.tolist() == np.where(layouts.fsdp, 1.0, 2.0).tolist()


def test_broadcast_collapses_uniform_fields_and_carries_memoised_rows():
    layouts = enumerate_layouts(ODD, gpus=12, gpus_per_node=4, global_batch=24)
    rows = np.nonzero(layouts.pp == 2)[0]
    value = layouts.memoised("rows", lambda: np.arange(len(layouts)) * 2)
    sub = layouts.take(rows, with_memo=True).broadcast()
    assert sub.pp == 2 and sub.tp.shape == (len(rows), 1)
    assert sub.memoised("rows", lambda: None).ravel().tolist() == value[rows].tolist()
    assert layouts.take(rows).memoised("rows", lambda: "recomputed") == "recomputed"  # not carried unless asked
