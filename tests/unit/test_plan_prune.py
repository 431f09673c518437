"""Issue 30 item 5: the planner drops layouts that cannot fit before the full memory model, by lower bounds of each
layout's worst-rank bytes (memory/state_floor.py's resting model state, then the full model at pipeline rank 0
alone: worst_rank_memory(first_rank_only=True)). A bound must never exceed the full model's number (a pruned
layout that fits would vanish from the plan), and the plan must be the same with and without pruning.

Models: DeepSeek-V3 and Mixtral-8x7B as published (tests/fixtures/hf, the benchmark's MoE cases), Llama-3-8B (dense),
a small MoE with shared experts and a tied GPT in fp32 (tests/unit/test_planner_core.py's shapes).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from backend.analytic.device import fits_device, need_bytes
from backend.analytic.layout import PipelineSchedule, RankPosition, ZeroStage
from backend.analytic.memory.rank_memory import rank_memory, worst_rank_memory
from backend.analytic.memory.state_floor import state_floor_bytes
from backend.analytic.steptime.hardware import get_hardware
from backend.hf.config import from_hf_config, load_hf_config
from backend.planner.held import HeldTraining
from backend.planner.search import plan, search
from backend.planner.space import enumerate_layouts
from backend.spec import ModelSpec

HF = Path(__file__).resolve().parents[1] / "fixtures" / "hf"
LLAMA = dict(norm="rmsnorm", mlp="swiglu", positions="rope", bias="none")
MOE = ModelSpec(vocab_size=32000, d_model=1024, n_layers=8, n_heads=16, n_kv_heads=8, ffn_hidden=2816, seq_len=1024,
                n_experts=8, top_k=2, n_shared_experts=1, shared_expert_gate=True, attention="flash", **LLAMA)
GPT_TIED = ModelSpec(vocab_size=50257, d_model=1536, n_layers=12, n_heads=12, seq_len=1024, tie_embeddings=True)
H100 = get_hardware("h100-sxm")


def _hf(name: str, attention: str = "flash", seq: int = 4096) -> ModelSpec:
    fields, _ = from_hf_config(load_hf_config(str(HF / f"{name}.json")), seq_len=seq)
    return ModelSpec(**{**fields, "seq_len": seq, "attention": attention})


# (model, GPUs, global batch, precision, held stack, device): dense, MoE (ep, etp), pp schedules, cp, every ZeRO
# stage, stacks, CUDA ranks (what a plan on a GPU profile prices) and CPU ranks
CASES = [(_hf("llama-3-8b"), 32, 64, "bf16-mixed", "shardlab", "cuda"), (MOE, 32, 64, "bf16-mixed", "shardlab", "cuda"),
         (MOE, 32, 64, "bf16-mixed", "shardlab", "cpu"), (GPT_TIED, 16, 32, "fp32", "shardlab", "cpu"),
         (_hf("mixtral-8x7b", seq=2048), 32, 64, "bf16-mixed", "shardlab", "cuda"),
         (_hf("deepseek-v3", seq=1024), 64, 128, "bf16-mixed", "shardlab", "cuda"),
         (MOE, 32, 64, "bf16-mixed", "megatron", "cuda"), (MOE, 32, 64, "bf16-mixed", "torchtitan", "cuda"),
         (MOE, 16, 32, "bf16-mixed", "deepspeed", "cuda")]


@pytest.mark.parametrize("model,gpus,batch,precision,stack,device", CASES,
                         ids=["llama3-8b", "moe", "moe-cpu", "gpt-tied-fp32-cpu", "mixtral", "deepseek-v3",
                              "moe-megatron", "moe-torchtitan", "moe-deepspeed"])
@pytest.mark.heavy
def test_plan_prune_bounds_never_exceed_the_full_model(model, gpus, batch, precision, stack, device):
    """Every enumerated layout (up to 20,000 drawn with a fixed seed): the state floor and the first-rank pass are each
    <= worst_rank_memory (neither bounds the other: the floor takes every pipeline rank, the other pass one)."""
    held = HeldTraining(precision=precision, stack=stack)
    layouts = enumerate_layouts(model, gpus=gpus, gpus_per_node=8, global_batch=batch, precision=precision,
                                device=device)
    layouts = replace(layouts, stack=held.stack_memory(model, device))
    if len(layouts) > 20_000:
        layouts = layouts.take(np.sort(np.random.default_rng(30).choice(len(layouts), 20_000, replace=False)))
    full, _ = worst_rank_memory(model, layouts)
    floor = state_floor_bytes(model, layouts)
    first, _ = worst_rank_memory(model, layouts, first_rank_only=True)
    assert (floor > 0).all()
    assert (floor <= full).all() and (first <= full).all(), "a bound over the full model would prune a fitting layout"
    exact = layouts.pp == 1
    assert np.array_equal(first[exact], full[exact])  # the planner keeps these without a second pass
    if model.is_moe:
        assert (layouts.ep > 1).any() and (layouts.cp > 1).any() == (str(model.attention) == "flash")
    assert {int(z) for z in np.unique(layouts.zero_stage)} == set(ZeroStage.ALL)
    assert (layouts.pp > 2).any() and (layouts.schedule == PipelineSchedule.DUALPIPEV).any()


@pytest.mark.heavy
def test_plan_prune_floor_is_tight_where_it_matters():
    """The floor is the model state itself, not a loose constant: at DeepSeek-V3 on 256 H100 it rules out most
    layouts on its own (the point of computing it)."""
    model = _hf("deepseek-v3")
    layouts = enumerate_layouts(model, gpus=256, gpus_per_node=8, global_batch=1024, device="cuda")
    floor = state_floor_bytes(model, layouts)
    assert np.count_nonzero(fits_device(floor, layouts, "cuda", H100.memory_bytes)) < 0.2 * len(layouts)


def test_plan_prune_floor_is_the_optimizer_step_moment_without_pipelining():
    """The floor is the optimizer.step moment's own bytes (resting state, input batch and the update's temporaries)
    where that moment has nothing more: one pipeline rank, no FSDP unsharding (its temporaries count: on CUDA ranks
    the foreach update's, as large as the owned fp32 state)."""
    model = _hf("mixtral-8x7b", seq=2048)
    layouts = enumerate_layouts(model, gpus=32, gpus_per_node=8, global_batch=64, device="cuda")
    layouts = layouts.take(np.nonzero((layouts.pp == 1) & ~np.asarray(layouts.fsdp, dtype=bool))[0])
    assert len(layouts) > 100
    step = rank_memory(model, layouts.group(np.arange(len(layouts))),
                       RankPosition(pp_rank=np.arange(1)[None, :], largest_zero1_share=True)).moments[1]
    assert np.array_equal(state_floor_bytes(model, layouts), np.asarray(step).reshape(-1))


def _same_plan(model: ModelSpec, gpus: int, batch: int, include_predicted: bool) -> None:
    kw = dict(gpus=gpus, gpus_per_node=8, hw=H100, global_batch=batch, top=10, include_predicted=include_predicted)
    pruned, full = plan(model, **kw), plan(model, prune=False, **kw)
    assert (pruned.searched, pruned.feasible, pruned.predicted_only_left_out) == \
        (full.searched, full.feasible, full.predicted_only_left_out)
    assert pruned.configs == full.configs and pruned.failed_checks == full.failed_checks


def _search_once_per_model_and_prune(monkeypatch: pytest.MonkeyPatch) -> None:
    """plan()'s search() (every layout's worst-rank memory, ~13 s unpruned for deepseek-v3 on 256 GPUs), once per
    model and prune flag: include_predicted only filters its result (planner/search._screen), so both plans of one
    model read the same search, as two calls would compute it."""
    from backend.planner import search as module

    done: dict[tuple[str, bool], tuple] = {}
    real = module.search

    def once(model: ModelSpec, **kw):
        key = (model.model_dump_json(), bool(kw.get("prune", True)))
        if key not in done:
            done[key] = real(model, **kw)
        return done[key]

    monkeypatch.setattr(module, "search", once)


@pytest.mark.heavy
def test_plan_prune_same_search_small_moe():
    """search(): the same layouts fit, with the same bytes, in the same order; a pruned layout's bytes are a bound
    that does not fit. The device is the median layout's need (fits_device's): half of them fit."""
    for model, gpus in ((MOE, 16), (_hf("mixtral-8x7b", seq=2048), 16)):
        layouts = enumerate_layouts(model, gpus=gpus, gpus_per_node=8, global_batch=2 * gpus, device="cuda")
        device_bytes = float(np.median(need_bytes(worst_rank_memory(model, layouts)[0], layouts, "cuda")))
        kw = dict(gpus=gpus, gpus_per_node=8, hw=H100, global_batch=2 * gpus, memory_bytes=device_bytes)
        (lay, mem_p, order_p), (_, mem_f, order_f) = search(model, **kw), search(model, prune=False, **kw)
        assert np.array_equal(order_p, order_f) and np.array_equal(mem_p[order_f], mem_f[order_f])
        fits = np.broadcast_to(fits_device(mem_p, lay, "cuda", device_bytes), mem_p.shape)
        assert ((mem_p <= mem_f) & (~fits | (mem_p == mem_f))).all()
        assert len(order_f) and len(order_f) < len(lay)


@pytest.mark.slow
@pytest.mark.parametrize("name,gpus,batch", [("deepseek-v3", 256, 1024), ("mixtral-8x7b", 64, 512)])
@pytest.mark.parametrize("attention", ["flash", "math"])
def test_plan_prune_same_plan_benchmark_moe_cases(name, gpus, batch, attention, monkeypatch):
    """benchmarks/planner_speed.py --moe's cases: the ranked list is identical with and without pruning."""
    _search_once_per_model_and_prune(monkeypatch)
    for include_predicted in (False, True):
        _same_plan(_hf(name, attention), gpus, batch, include_predicted)


@pytest.mark.parametrize("model,gpus,batch,precision,stack,device", CASES[:6],
                         ids=["llama3-8b", "moe", "moe-cpu", "gpt-tied-fp32-cpu", "mixtral", "deepseek-v3"])
@pytest.mark.heavy
def test_plan_prune_later_ranks_complete_the_first(model, gpus, batch, precision, stack, device):
    """search()'s second pass evaluates pipeline ranks 1.. only (later_ranks_only), on a table restricted with its
    memoised terms (take(with_memo=True)), and takes the larger of that and rank 0's: byte for byte the full model's
    worst rank, on every pipelined layout (up to 5,000 drawn)."""
    held = HeldTraining(precision=precision, stack=stack)
    layouts = enumerate_layouts(model, gpus=gpus, gpus_per_node=8, global_batch=batch, precision=precision,
                                device=device)
    layouts = replace(layouts, stack=held.stack_memory(model, device))
    piped = np.nonzero(layouts.pp > 1)[0]
    layouts = layouts.take(np.sort(np.random.default_rng(5).choice(piped, min(5_000, len(piped)), replace=False)))
    full, at = worst_rank_memory(model, layouts)
    first, _ = worst_rank_memory(model, layouts, first_rank_only=True)
    later, later_at = worst_rank_memory(model, layouts.take(np.arange(len(layouts)), with_memo=True),
                                        later_ranks_only=True)
    assert np.array_equal(np.maximum(first, later), full)
    assert np.array_equal(np.where(first >= later, 0, later_at), at)


@pytest.mark.parametrize("model,gpus,batch,precision,stack,device", [CASES[0], CASES[5], CASES[6]],
                         ids=["llama3-8b", "deepseek-v3", "moe-megatron"])
@pytest.mark.heavy
def test_plan_prune_enumeration_state_key_is_the_floors_grouping(model, gpus, batch, precision, stack, device):
    """enumerate_layouts stores the state floor's grouping from its grid (memoised on the table); the floor through it
    is the floor through state_floor's own key (a copy of the table drops the memo), byte for byte."""
    held = HeldTraining(precision=precision, stack=stack)
    kw = dict(gpus=gpus, gpus_per_node=8, global_batch=batch, precision=precision, device=device)
    layouts = enumerate_layouts(model, stack=held.stack_memory(model, device), **kw)
    assert np.array_equal(state_floor_bytes(model, layouts), state_floor_bytes(model, replace(layouts)))
    held_policy = enumerate_layouts(model, extra_recompute=(("block", 1), ("layers", 2)), **kw)  # dedupes rows
    assert np.array_equal(state_floor_bytes(model, held_policy), state_floor_bytes(model, replace(held_policy)))
