"""Tensor parallelism (Megatron-style, optionally with sequence parallelism) via DTensor
`parallelize_module` on ctx.mesh["tp"], plus the TP×DP mixes (dp flavour from `data_parallel.composable_wrap`).
The plan is built from the placement table the analytic model reads too (backend/analytic/tp_placement.py); the
table below summarises it.

Per-rank parameter layout (t = tp degree; "rows" = dim 0 of the weight as nn.Linear/nn.Embedding store it;
DTensor shards like torch.chunk, so a dimension not divisible by t gives the first ranks ceil(n/t)):

| module                 | plan (no SP)                  | plan (SP)                    | weight per    | bias per     |
|                        |                               |                              | rank          | rank         |
|------------------------|-------------------------------|------------------------------|---------------|--------------|
| tok_emb (V, C)         | RowwiseParallel(in Replicate, | RowwiseParallel(in           | V/t rows × C  | -            |
|                        | out Replicate)                | Replicate, out Shard(1))     |               |              |
| pos_emb (S, C)         | RowwiseParallel(in Replicate, | RowwiseParallel(in           | S/t rows × C  | -            |
|                        | out Replicate)                | Replicate, out Shard(0))     |               |              |
| ln1, ln2, norm         | replicated plain params       | SequenceParallel (replicated | C             | C            |
|                        |                               | DTensor params)              |               |              |
| attn (module input)    | PrepareModuleInput(Replicate, | PrepareModuleInput(Shard(1)  |               |              |
|                        | DTensor out)                  | -> Replicate, DTensor out)   |               |              |
| attn.q (C, C)          | ColwiseParallel               | ColwiseParallel              | C/t rows × C  | C/t          |
| attn.k, attn.v (kv, C) | ColwiseParallel               | ColwiseParallel              | kv/t rows × C | kv/t         |
| attn.o (C, C)          | RowwiseParallel               | RowwiseParallel(out          | C × C/t cols  | C            |
|                        |                               | Shard(1))                    |               | (replicated) |
| mlp (module input)     | PrepareModuleInput(Replicate, | PrepareModuleInput(Shard(1)  |               |              |
|                        | DTensor out)                  | -> Replicate, DTensor out)   |               |              |
| mlp.fc_in (F, C)       | ColwiseParallel               | ColwiseParallel              | F/t rows × C  | F/t          |
| mlp.fc_out (C, F)      | RowwiseParallel               | RowwiseParallel(out          | C × F/t cols  | C            |
|                        |                               | Shard(1))                    |               | (replicated) |
| mlp.gate, mlp.up (F,C) | ColwiseParallel (SwiGLU)      | ColwiseParallel              | F/t rows × C  | F/t          |
| mlp.down (C, F)        | RowwiseParallel (SwiGLU)      | RowwiseParallel(out          | C × F/t cols  | C            |
|                        |                               | Shard(1))                    |               | (replicated) |
| MoE shared.* (shared   | as the (expert) MLP           | as the (expert) MLP, inside  | as mlp        | as mlp       |
| experts)               |                               | the MoE's gather/scatter     |               |              |
| MoE router,            | replicated plain params       | replicated plain params      |               |              |
| shared_gate            |                               |                              |               |              |
| MoE router (E, C)      | replicated plain param        | replicated plain param       | E × C         | -            |
| MoE experts.e          | Colwise / Rowwise (as mlp)    | Colwise / Rowwise; MoE       | as mlp, per   | as mlp       |
| fc_in/out              |                               | output Replicate -> Shard(1) | expert        |              |
| lm_head (V, C)         | ColwiseParallel(out           | ColwiseParallel(in Shard(1), | V/t rows × C  | -            |
|                        | Replicate)                    | out Replicate)               |               |              |
| lm_head, loss parallel | ColwiseParallel(out           | ColwiseParallel(in Shard(1), | V/t rows × C  | -            |
|                        | Shard(-1), DTensor out)       | out Shard(-1), DTensor)      |               |              |

Gradients have the parameter's per-rank size: DTensor computes the vocab-parallel embedding weight grad
Replicate (full (V, h) on every rank); a grad hook slices it back to this rank's rows (`GradLikeParam`).
SP LayerNorm grads stay Partial over tp through the microbatches and are all-reduced once per step.

Activations: without SP every rank holds full (B, T, C) residual/LayerNorm activations; with SP those are
(B, T/t, C). lm_head gathers the full logits (B, T, V) on every tp rank (Replicate output), so the cross-entropy
runs on full logits, unless the spec's loss parallel is on (`vocab_parallel_loss`: train.loss_parallel, or a stack
that defaults it, spec/stack_rules.loss_parallel_on): then the logits stay (B, T, V/t) DTensors and the loss runs
under torch's `loss_parallel()` (forward and backward, as torchtitan's train context does: torchtitan
train.py get_train_context at 9dec370), all-reducing per token the max, the sum of exponentials and the target
logit instead of gathering the logits; the attention scores (B, a/t, T, T) and MLP hidden (B, T, F/t)
are split.

Comm per microbatch (b = micro_batch, s = seq_len, h = d_model, V = vocab; payload bytes, fp32 = 4 B):
  no SP, per dense layer: forward 2 all_reduce of b·s·h (attn.o, fc_out), backward 2 all_reduce of b·s·h
    (the attn / mlp input boundary: q, k, v share one reduction, Megatron's f operator);
  SP, per dense layer: forward 2 all_gather (output b·s·h) + 2 reduce_scatter (input b·s·h), backward the
    same 2 + 2; plus, once per STEP, an all_reduce of each replicated LayerNorm weight and bias grad (h each;
    ln1, ln2 of every layer and the final norm): SequenceParallel leaves them Partial over tp, and
    step.reduce_partial_grads (pure TP, PP×TP) or FSDP2/replicate's post-backward (dp mixes)
    redistributes them to Replicate explicitly;
  embeddings: forward all_reduce of b·s·h (tok_emb) + s·h (pos_emb) without SP, reduce_scatter of the same
    with SP (pos_emb: Shard(0) of (s, h));
  lm_head: forward all_gather of the logits b·s·V; backward all_reduce of its input b·s·h (no SP) or
    reduce_scatter b·s·h (SP: input Shard(1) gathered in forward = all_gather b·s·h).
  MoE experts (no expert parallelism): each expert's fc_in/fc_out reduce per expert (forward all_reduce of
    the expert's rows, backward all_reduce of its input rows).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from backend.analytic.tp_placement import COLWISE, HEADS, POSITIONS, REPLICATE, SEQUENCE, TpRule, module_rule
from backend.models.gpt import MoE, tie_weights
from backend.spec import ExperimentSpec
from backend.spec.stack_rules import loss_parallel_on
from backend.strategies.context import RankContext
from backend.torch_compat import ParallelStyle


def vocab_parallel_loss(spec: ExperimentSpec) -> bool:
    """The loss runs on vocab-sharded logits: tp > 1 and loss parallel on (spec/stack_rules.loss_parallel_on)."""
    return spec.parallel.tp > 1 and loss_parallel_on(spec)


def loss_context(spec: ExperimentSpec) -> AbstractContextManager:
    """torch's `loss_parallel()` around a microbatch's forward and backward when the loss is vocab-parallel."""
    return loss_parallel() if vocab_parallel_loss(spec) else nullcontext()


def tp_plan(model: nn.Module, sp: bool, whole_experts: bool = False, sharded_logits: bool = False) -> dict:
    """The plan for whatever part of the GPT lives on this rank (pipeline stages have None holes): every module the
    placement table (backend/analytic/tp_placement.py) splits, as its DTensor style, plus the activation layouts
    around each block's attention and MLP. whole_experts (ep > 1: analytic/expert_layout.py, etp = 1): the routed
    experts stay plain, unsplit modules on every tp rank. sharded_logits (loss parallel): lm_head's output stays a
    DTensor sharded over the vocabulary, for `loss_context`."""
    plan: dict = {}
    for name, _ in model.named_modules():
        if whole_experts and ".mlp.experts." in name:
            continue
        rule = module_rule(name)
        style = _style(rule, sp) if rule is not None else None
        if style is not None:
            plan[name] = style
    for name, block in model.layers.items():
        pre = f"layers.{name}"
        plan[f"{pre}.attn"] = _gather_input(sp)
        if not isinstance(block.mlp, MoE):
            plan[f"{pre}.mlp"] = _gather_input(sp)
        elif sp:
            plan[f"{pre}.mlp"] = MoESequenceParallel()
    if sharded_logits and "lm_head" in plan:
        plan["lm_head"] = ColwiseParallel(input_layouts=Shard(1) if sp else Replicate(), output_layouts=Shard(-1),
                                          use_local_output=False)
    return plan


_LAYOUTS = {REPLICATE: Replicate(), SEQUENCE: Shard(1), POSITIONS: Shard(0)}


def _style(rule: TpRule, sp: bool) -> ParallelStyle | None:
    """A placement rule as DTensor's style (None: nothing to apply)."""
    if rule.placement == REPLICATE:
        if rule.partial_grads:
            return ParamsAs(Replicate())
        return SequenceParallel(use_local_output=rule.local_output) if rule.sequence_norm and sp else None
    if rule.placement == HEADS:
        return ParamsAs(Shard(0))
    layouts = {}
    layout_in = (rule.input_sp or rule.input) if sp else rule.input
    layout_out = (rule.output_sp or rule.output) if sp else rule.output
    if layout_in is not None:
        layouts["input_layouts"] = _LAYOUTS[layout_in]
    if layout_out is not None:
        layouts["output_layouts"] = _LAYOUTS[layout_out]
    return (ColwiseParallel if rule.placement == COLWISE else RowwiseParallel)(**layouts)


class ParamsAs(ParallelStyle):
    """The module's parameters become DTensors of one placement over tp, its inputs and outputs untouched: the model
    reads them through `models.gpt.local_weight` (q / k norms, MLA's latent projections: Replicate with grads summed
    over tp; gpt-oss's sinks: Shard(0), split by heads)."""

    def __init__(self, placement):
        super().__init__()
        self.placement = placement

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        def partition(name, mod, mesh):
            for key, q in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(key, nn.Parameter(distribute_tensor(q, mesh, [self.placement])))

        return distribute_module(module, device_mesh, partition)


def _gather_input(sp: bool) -> PrepareModuleInput:
    """One Replicate DTensor shared by q/k/v (or fc_in): their Partial input grads add up locally and are
    reduced ONCE at this boundary (Megatron's f operator: 1 all-reduce, or 1 reduce-scatter under SP),
    instead of once per Colwise module as separate from_local conversions would do."""
    src = Shard(1) if sp else Replicate()
    return PrepareModuleInput(input_layouts=(src,), desired_input_layouts=(Replicate(),), use_local_output=False)


class MoESequenceParallel(ParallelStyle):
    """The router must see every token of the sequence: gather the input, scatter the combined output back."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                           use_local_output=True)._apply(module, device_mesh)
        PrepareModuleOutput(output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),),
                            use_local_output=True)._apply(module, device_mesh)
        return module


def apply_tp(ctx: RankContext, model: nn.Module) -> nn.Module:
    """parallelize_module with `tp_plan` over mesh["tp"] (works on a meta model)."""
    p = ctx.spec.parallel
    if p.tp > 1:
        plan = tp_plan(model, p.sequence_parallel, whole_experts=p.ep > 1 and p.etp == 1,
                       sharded_logits=vocab_parallel_loss(ctx.spec))
        parallelize_module(model, ctx.mesh["tp"], plan)
        tie_weights(model)  # parallelize_module distributed the tied weight twice (both Shard(0)): tie them again
    return model


def register_grad_hooks(model: nn.Module) -> None:
    """Once the DTensor parameters are materialized: keep every grad at its parameter's sharded size."""
    for q in model.parameters():
        if isinstance(q, DTensor):
            q.register_hook(GradLikeParam(q))


class GradLikeParam:
    """DTensor's vocab-parallel embedding backward returns the weight grad Replicate: the FULL (V, h)
    gradient on every tp rank. Keep only this rank's rows (Replicate -> Shard is a local slice, no comm;
    cloned so the full buffer is freed), so the persistent .grad has the parameter's sharded size."""

    def __init__(self, q: DTensor):
        self.q = q

    def __call__(self, g):
        q = self.q
        if not isinstance(g, DTensor) or g.placements == q.placements or any(pl.is_partial() for pl in g.placements):
            return g
        local = g.redistribute(q.device_mesh, q.placements).to_local().clone()
        return DTensor.from_local(local, q.device_mesh, q.placements, run_check=False, shape=q.shape, stride=q.stride())


def notes(spec: ExperimentSpec) -> list[str]:
    if vocab_parallel_loss(spec):
        return ["TP: loss parallel: lm_head keeps the logits sharded over the vocabulary (B, T, V/tp) and the "
                "cross-entropy runs under torch's loss_parallel() (per-token max, sum of exponentials and target "
                "logit all-reduced over tp)."]
    return ["TP: lm_head all-gathers full logits (B, T, V) on every tp rank (Replicate output, no loss_parallel)."]
