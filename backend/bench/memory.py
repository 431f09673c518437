"""Per-category memory of one training step, from torch's MemTracker / FSDPMemTracker.

What the numbers mean (one measured step, per rank):
- `categories` (the measured values compared with predictions): every category at the moment the
  Activation category peaks, i.e. the end of the (last) microbatch's forward = the start of backward,
  the moment the textbook "model states + activations" formulas describe. params/grads/optimizer are
  then the resident state (plus FSDP2's unsharded units alive at that moment); activations are what
  forward keeps for backward.
- `peak_bytes`: tracked bytes (all categories) at the step's own total peak, and `at_peak` its
  breakdown. That peak usually falls a little later, in backward, when gradient temporaries (Temp ->
  other) grow faster than activations are freed, or inside optimizer.step (foreach temporaries).
- `high_water`: each category's own maximum during the step (includes transient temporaries).

Category mapping:
  MemTracker      Parameter -> params, Gradient -> grads, Optstate -> optimizer, Activation -> activations,
                  Buffer / Temp (backward temporaries) / Other -> other.
  FSDPMemTracker  Sharded+Unsharded Param and All Gather buffers -> params, Sharded+Unsharded Grad and
                  Reduce Scatter buffers -> grads, OptState -> optimizer, Activation -> activations,
                  Buffer / Temp / Inputs -> other.
FSDP2's pre-forward unshard is never the activation-peak moment: FSDPMemTracker books the all-gather output and
the fresh unsharded parameters as Activation until `_pre_forward` returns (parameter bytes, wrong category).
DDP's gradient buckets (MemTracker would see them as untracked or Activation): DDP runs with
gradient_as_bucket_view=True and zero_grad(set_to_none=False), so `param.grad` stays a view of its bucket
across steps and microbatches and the tracker tags the bucket storage as Gradient: one copy, counted once.
(With set_to_none=True the no_sync microbatches allocate fresh grads next to the buckets: 2x gradients.)

Pipelines: several stage modules per rank (interleaved / looped / V placements) each start their own
forwards while other stages' backwards are pending, so the per-module stats are reset on every root
re-entry and a missing module stat is recreated on demand (`_LenientStats`); the category snapshots do
not depend on those stats. FSDP runs instrument every local stage module, and parameters FSDP ignores
(EP experts, `ignored_params`) count as Sharded Param / Sharded Grad (they are rank-local state).

Split-backward schedules (zero_bubble, zbv) call `autograd.grad(inputs=...)`, which ModTracker's
multi-grad hooks on module outputs break, so they run with `hookless=True`: the same trackers with the
module tracker replaced by `_NoModules` (no module hooks at all). What that measures: params, buffers,
existing grads and optimizer state are attributed by storage identity exactly as before (track_external /
the FSDP instrumentation, optimizer step hooks); a storage allocated by an op outside autograd's
backward (graph task id -1) is Activation, one allocated inside backward is Temp (-> other). The only
difference from the hooked trackers: a recompute (activation checkpointing) in backward is not seen as
forward, so recomputed activations count as Temp (other), not Activation.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from functools import wraps
from typing import Any

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from backend.torch_compat import FSDPMemTracker, MemTracker, tracked_outputs_walked
from backend.torch_compat import FSDPModMemStats as _FSDPModMemStats
from backend.torch_compat import FSDPRefType as _FSDPRefType
from backend.torch_compat import FSDPState as _FSDPState
from backend.torch_compat import MemRefType as _MemRefType
from backend.torch_compat import ModMemStats as _ModMemStats
from backend.torch_compat import PipelineStageBase as _PipelineStageBase

_TOTAL = "Total"
CATEGORY_OF = {
    "Parameter": "params_bytes", "Sharded Param": "params_bytes", "Unsharded Param": "params_bytes",
    "All Gather": "params_bytes",
    "Gradient": "grads_bytes", "Sharded Grad": "grads_bytes", "Unsharded Grad": "grads_bytes",
    "Reduce Scatter": "grads_bytes",
    "Optstate": "optimizer_bytes", "OptState": "optimizer_bytes",
    "Activation": "activations_bytes",
}
OURS = ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "other_bytes")


def map_snapshot(snap: dict[str, int]) -> dict[str, int]:
    """Tracker categories -> ours (Total dropped)."""
    out = dict.fromkeys(OURS, 0)
    for k, v in snap.items():
        if k == _TOTAL:
            continue
        out[CATEGORY_OF.get(str(k), "other_bytes")] += int(v)
    return out


class _LenientStats(WeakIdKeyDictionary):
    """memory_tracking that recreates a module's stats when a reset dropped them while its backward was
    still pending (another stage's forward started in between); `make(module)` builds a fresh entry."""

    def __init__(self, make: Any) -> None:
        super().__init__()
        self._make = make

    def __getitem__(self, key: Any) -> Any:
        try:
            return super().__getitem__(key)
        except KeyError:
            self[key] = stats = self._make(key)
            return stats


class _NoModules:
    """Stands in for ModTracker: no module hooks; backward = inside an autograd graph task."""

    parents: set[str] = set()

    @property
    def is_bw(self) -> bool:
        return torch._C._current_graph_task_id() != -1

    def get_known_fqn(self, module: nn.Module) -> str:
        return type(module).__name__

    def register_user_hooks(self, *hooks: Any) -> None:
        pass

    def clear_user_hooks(self) -> None:
        pass

    def __enter__(self) -> _NoModules:
        return self

    def __exit__(self, *args: Any) -> None:
        pass


_GATHER_STATES = (_FSDPState.PRE_FW, _FSDPState.PRE_BW)


class _HighWater:
    """Mixin: per-category maxima, and a snapshot of every category when activations are at their maximum."""

    in_reduce_grad = False
    """Inside pipelining's REDUCE_GRAD phase (set by `flag_reduce_grad`)."""
    unsharding = False
    """Inside FSDP2's pre-forward unshard (set by the FSDP tracker's `_fsdp_state_pre_forward` override)."""
    skip_gathers = True
    """FSDP2's all-gather hook moments are not activation-peak candidates (make_tracker: False under pipelining)."""
    _act_key: object = None
    """The snapshots' Activation key (the tracker's reference-type enum member), found at the first moment."""

    def _init_high_water(self, stats_cls: Any, hookless: bool) -> None:
        if hookless:
            self._mod_tracker = _NoModules()
        fqn = self._mod_tracker.get_known_fqn  # type: ignore[attr-defined]
        self.memory_tracking = _LenientStats(lambda m: stats_cls(fqn(m) or type(m).__name__))
        self.high_water: dict[Any, dict[Any, int]] = defaultdict(lambda: defaultdict(int))
        self.at_act_peak: dict[Any, dict[Any, int]] = {}
        self.others_at_act_peak: dict[Any, dict[Any, dict[Any, int]]] = {}
        """Every other device's snapshot at that device's activation peak (the host's model states under offload)."""
        self._act_peak: dict[Any, int] = {}

    def _update_peak_stats(self, peak_state: Any) -> None:  # overrides the tracker's hook, called after every op
        # Only the tracker-wide peak is kept: the torch hook also walks every module's stats on every op to keep
        # module-wise peaks, which nothing here reads; that walk was about half the memory step's time.
        skip = self.in_reduce_grad or self.unsharding or (
            self.skip_gathers and getattr(self, "_fsdp_state", None) in _GATHER_STATES)
        for dev, snap in self._curr_mem_snap.items():  # type: ignore[attr-defined]
            if self._peak_mem.get(dev, 0) < snap[_TOTAL]:  # type: ignore[attr-defined]
                self._peak_mem[dev] = snap[_TOTAL]  # type: ignore[attr-defined]
                self._peak_mem_snap[dev] = dict(snap)  # type: ignore[attr-defined]
            hw = self.high_water[dev]
            for k, v in snap.items():
                if v > hw[k]:
                    hw[k] = v
            if self._act_key not in snap:  # the first moment: the tracker's Activation key, looked up once
                self._act_key = next((k for k in snap if getattr(k, "value", k) == "Activation"), None)
            act = snap.get(self._act_key, 0)
            # >=: of equal microbatch peaks keep the last one, when earlier microbatches' gradients exist
            # pipelining's REDUCE_GRAD (FSDP2 / replicate post-backward, outside autograd) books its reduce buffers
            # as Activation: that phase is gradient reduction, not a candidate for the activation peak; nor is FSDP2's
            # pre-forward unshard (`unsharding`, set by the FSDP tracker: its parameter bytes are booked as Activation)
            # FSDP2's pre-forward / pre-backward all-gather: its output buffer is `torch.empty`'d (booked as Activation)
            # one op before FSDPMemTracker re-types it All Gather at `_allgather_base_`; no activation is made there.
            # Not under pipelining (skip_gathers False): analytic/memory/fsdp_state.py models that moment for PP x FSDP
            # peaks
            if act > 0 and not skip and act >= self._act_peak.get(dev, 0):
                self._act_peak[dev] = act
                self.at_act_peak[dev] = dict(snap)
                self.others_at_act_peak[dev] = {d: dict(s) for d, s in self._curr_mem_snap.items() if d != dev}

    def new_iteration_hook(self, module: nn.Module, args: Any) -> None:
        """Microbatches call the root module again within one step; torch's trackers reject that as a new
        iteration, so the per-module stats are reset (the category snapshots we read are kept)."""
        if module in self.memory_tracking and not self._mod_tracker.is_bw:  # type: ignore[attr-defined]
            self.reset_mod_stats()  # type: ignore[attr-defined]


class CategoryMemTracker(_HighWater, MemTracker):
    def __init__(self, hookless: bool = False) -> None:
        super().__init__()
        self._init_high_water(_ModMemStats, hookless)

    def track_as(self, tensors: Iterable[torch.Tensor], category: Any) -> None:
        """Long-lived storages no module or optimizer state names (the distributed optimizer's fp32 main-grad
        buffers and masters), booked under `category` (a MemTracker reference type)."""
        for t in tensors:
            self._update_and_maybe_create_winfos(t, category)

    def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
        name = self._mod_tracker.get_known_fqn(module)
        if set(self._mod_tracker.parents) - {name} == {"Global"}:
            self.new_iteration_hook(module, inputs)
        super()._pre_fw_hook(module, inputs)


def _fsdp_tracker(roots: list[nn.Module], optimizer: torch.optim.Optimizer, hookless: bool) -> Any:
    from torch.distributed.tensor import DTensor

    class CategoryFSDPMemTracker(_HighWater, FSDPMemTracker):
        """FSDPMemTracker over every local root module (pipeline stages), counting FSDP-ignored params."""

        def __init__(self, mods: list[nn.Module], optm: torch.optim.Optimizer) -> None:
            super().__init__(mods[0], optm)
            self._roots = mods
            self._ignored_hooks: list[Any] = []
            self._init_high_water(_FSDPModMemStats, hookless)

        def _instrument_fsdp_module(self) -> None:
            for root in self._roots:
                self._root_mod = root
                super()._instrument_fsdp_module()
            self._root_mod = self._roots[0]
            self._track_ignored_params()

        def _fsdp_state_pre_forward(self, fsdp_mod: nn.Module, orig: Any) -> Any:
            """Flags FSDP2's pre-forward unshard: FSDPMemTracker books the all-gather output and the fresh unsharded
            parameter storages as Activation until its wrapper re-tags them once `_pre_forward` returns
            (torch/distributed/_tools/fsdp2_mem_tracker.py `_fsdp_state_pre_forward`, `__torch_dispatch__`), so a
            moment inside it has parameter bytes in the wrong category and cannot be the activation peak (it makes
            no activation). Pure zero3 at world 2 used to peak there: params +57%, the previous block's all-gather
            buffer and the root counted (benchmarks/family_accuracy.py --only zero3)."""
            inner = super()._fsdp_state_pre_forward(fsdp_mod, orig)

            @wraps(inner)
            def flagged(*args: Any, **kwargs: Any) -> Any:
                self.unsharding = True
                try:
                    return inner(*args, **kwargs)
                finally:
                    self.unsharding = False

            return flagged

        def track_as(self, tensors: Iterable[torch.Tensor], category: Any) -> None:
            for t in tensors:
                self._update_and_maybe_create_winfos(t, category)

        def _track_ignored_params(self) -> None:
            """Params no FSDP group manages (ignored_params: plain experts, or experts split over tp by etp, which are
            DTensors FSDP does not own): rank-local state, counted as sharded. An FSDP group's sharded params are
            tracked already (`_instrument_fsdp_sharded_params_grads`)."""
            for root in self._roots:
                for q in root.parameters():
                    local = q.to_local() if isinstance(q, DTensor) else q
                    if local.untyped_storage() in self._WINFO:  # FSDP-managed (sharded / replicated)
                        continue
                    self._update_and_maybe_create_winfos(q, _FSDPRefType.SHARDED_PARAM)
                    if q.grad is not None:
                        self._update_and_maybe_create_winfos(q.grad, _FSDPRefType.SHARDED_GRAD)
                    self._ignored_hooks.append(q.register_post_accumulate_grad_hook(self._tag_ignored_grad))

        def _tag_ignored_grad(self, q: torch.Tensor) -> None:
            self._update_and_maybe_create_winfos(q.grad, _FSDPRefType.SHARDED_GRAD)

        def _deregister_module_and_optimizer_hooks(self) -> None:
            super()._deregister_module_and_optimizer_hooks()
            for h in self._ignored_hooks:
                h.remove()
            self._ignored_hooks.clear()

    return CategoryFSDPMemTracker(roots, optimizer)


def make_tracker(modules: list[nn.Module], optimizer: torch.optim.Optimizer, *, fsdp: bool,
                 hookless: bool = False, skip_gathers: bool = True) -> Any:
    """A tracker already told about the long-lived state (params, grads, optimizer) made before it.
    hookless: no module hooks (split-backward pipeline schedules; see the module docstring).
    skip_gathers: FSDP2's all-gather hooks cannot be the activation-peak moment (False under pipelining)."""
    if fsdp:
        tracker = _fsdp_tracker(modules, optimizer, hookless)
        tracker.skip_gathers = skip_gathers
        return tracker
    tracker = CategoryMemTracker(hookless)
    inner = getattr(optimizer, "optim", None)  # ZeroRedundancyOptimizer / the distributed optimizer: the local .optim
    tracker.track_external(*modules, inner if isinstance(inner, torch.optim.Optimizer) else optimizer)
    tracked = getattr(optimizer, "tracked", None)  # the distributed optimizer's main grads and fp32 masters
    if tracked is not None:
        buffers = tracked()
        tracker.track_as(buffers["grads"], _MemRefType.GRAD)
        tracker.track_as(buffers["optimizer"], _MemRefType.OPT)
    return tracker


@contextmanager
def _flag_reduce_grad(tracker: Any) -> Iterator[None]:
    """torch.distributed.pipelining calls FSDP2's post_backward from `_PipelineStageBase.perform_reduce_grad`
    (stage.py), outside autograd's graph task, so the trackers book the reduce-scatter / all-reduce buffers as
    Activation (FSDPMemTracker only re-types `c10d._reduce_scatter_base_` inputs; FSDP2 2.13 calls other ops).
    Mark that phase so it cannot become the activation-peak moment."""
    orig = _PipelineStageBase.perform_reduce_grad

    def wrapped(stage: Any, *args: Any, **kwargs: Any) -> Any:
        tracker.in_reduce_grad = True
        try:
            return orig(stage, *args, **kwargs)
        finally:
            tracker.in_reduce_grad = False

    _PipelineStageBase.perform_reduce_grad = wrapped  # type: ignore[method-assign]
    try:
        yield
    finally:
        _PipelineStageBase.perform_reduce_grad = orig  # type: ignore[method-assign]


@contextmanager
def tracking(tracker: Any, modules: list[nn.Module]) -> Iterator[Any]:
    """`with tracker`, plus (FSDP) a pre-forward hook on every local root that resets module stats between
    microbatches. Registered after entering, so it runs before the tracker's own wrapped FSDP pre-forward."""
    with tracker, _flag_reduce_grad(tracker), tracked_outputs_walked():
        handles = []
        if not isinstance(tracker, CategoryMemTracker):
            handles = [m.register_forward_pre_hook(tracker.new_iteration_hook, prepend=True) for m in modules]
        try:
            yield tracker
        finally:
            for h in handles:
                h.remove()


def track_inputs(tracker: Any, tensors: Iterable[torch.Tensor]) -> None:
    """The step's input batch (made before tracking starts) counts as other."""
    tensors = tuple(tensors)
    if hasattr(tracker, "track_inputs"):  # FSDPMemTracker (its track_external is a no-op)
        tracker.track_inputs(tensors)
    else:
        tracker.track_external(*tensors)


def track_resident(tracker: Any, tensors: Iterable[torch.Tensor]) -> None:
    """Tensors a strategy keeps from step to step beside its modules and optimizer (`Prepared.resident`: the pipeline
    receive buffers), made before tracking starts: booked as activations, where the prediction counts them. Left
    untracked, the tracker saw only those an op happened to write during the step."""
    category = _MemRefType.ACT if isinstance(tracker, CategoryMemTracker) else _FSDPRefType.ACT
    tracker.track_as(tensors, category)


def breakdown(tracker: Any, device: torch.device, states: torch.device | None = None) -> dict[str, Any]:
    """Measured categories (at the activation peak), the total peak, and the other two views; bytes.
    `states`: where the model states live when not on `device` (the host under FSDP2's CPUOffloadPolicy on CUDA):
    that device's bytes are added to every view, taken at the compute device's activation peak for that view."""
    peak = _for_device(tracker.get_tracker_snapshot("peak"), device)
    at_act = _for_device(tracker.at_act_peak, device)
    hw = _for_device(tracker.high_water, device)
    if states is not None and states.type != device.type:
        at_act = _merged(at_act, _for_device(_for_device(getattr(tracker, "others_at_act_peak", {}), device,
                                                         raw=True), states))
        peak = _merged(peak, _for_device(tracker.get_tracker_snapshot("peak"), states))
        hw = _merged(hw, _for_device(tracker.high_water, states))
    return {"categories": map_snapshot(at_act or peak), "moment": "activation_peak" if at_act else "total_peak",
            "peak_bytes": int(peak.get(_TOTAL, 0)), "at_peak": map_snapshot(peak), "high_water": map_snapshot(hw),
            "tracker_at_activation_peak": at_act, "tracker_at_peak": peak, "tracker_high_water": hw}


def _for_device(snaps: dict[Any, dict], device: torch.device, raw: bool = False) -> dict:
    for dev, snap in snaps.items():
        d = torch.device(dev)
        if d.type == device.type and (device.index is None or d.index in (None, device.index)):
            return snap if raw else {str(getattr(k, "value", k)): int(v) for k, v in snap.items()}
    return {}


def _merged(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    """Two devices' tracker snapshots as one (bytes per category summed, Total included)."""
    return {k: a.get(k, 0) + b.get(k, 0) for k in {**a, **b}}


def cuda_peaks(device: torch.device) -> tuple[int | None, int | None]:
    if device.type != "cuda":
        return None, None
    return int(torch.cuda.max_memory_allocated(device)), int(torch.cuda.max_memory_reserved(device))


def rss_bytes() -> int | None:
    try:
        import psutil
    except ImportError:
        return None
    return int(psutil.Process().memory_info().rss)
