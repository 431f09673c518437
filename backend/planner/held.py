"""What a plan holds fixed while it searches the layouts: the training settings every candidate trains with.

The Plan page's controls and the CLI's flags set them, or an imported config (torchtitan, Megatron-LM, DeepSpeed)
brings its own: its precision (fp8 with its recipe and float8 all-gather), its optimizer, and its recompute policy,
which is searched besides the planner's own (planner/space.SEARCHED_RECOMPUTE) so that the imported layout itself is
one of the candidates and ranks as it predicts when opened directly. The software stack (spec/stacks.py: its kernels,
dtypes and overlaps, the stack's defaults or the settings a config or a person set) is held the same way: every planned
spec carries it, so the step-time model times each layout as that stack runs it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from backend.recompute_policy import parse as parse_recompute
from backend.spec.choices import Precision, Stack
from backend.spec.stacks import SETTINGS as STACK_SETTINGS
from backend.spec.stacks import STACKS, Repertoire

if TYPE_CHECKING:
    from backend.analytic.stack_memory import EngineCompile, StackMemory
    from backend.spec import ModelSpec

PRECISIONS = tuple(p.value for p in Precision)


@dataclass(frozen=True)
class HeldTraining:
    precision: str = "bf16-mixed"
    optimizer: str = "adamw"
    recompute: str | None = None
    """A recompute policy searched besides the planner's own (an imported config's: uniform:4, block:2, ...)."""
    recompute_ops: tuple[str, ...] | None = None
    """The ops `op` recompute saves (None: torchtitan's list)."""
    recompute_modules: tuple[str, ...] | None = None
    """What selective recompute checkpoints under the megatron stack (Megatron's --recompute-modules; None: its
    default, core_attn)."""
    fp8_recipe: str | None = None
    fp8_all_gather: bool | None = None
    source: str | None = None
    """Where the settings come from, in words (an imported config), or None (the page's / the flags' choices)."""
    stack: str = "shardlab"
    """The stack every layout trains with (spec/stacks.py)."""
    stack_settings: tuple[tuple[str, Any], ...] = ()
    """The stack settings set on their own ((name, value) of spec/stacks.SETTINGS); the rest are the stack's
    defaults."""

    @classmethod
    def of_train(cls, train: dict[str, Any], *, precision: str | None = None,
                 source: str | None = None) -> HeldTraining:
        """The settings of a spec's `train` section (a dict, as import-config writes it); `precision` overrides."""
        ops, modules = train.get("recompute_ops"), train.get("recompute_modules")
        return cls(precision=str(precision or train.get("precision") or "bf16-mixed"),
                   optimizer=str(train.get("optimizer") or "adamw"), recompute=train.get("recompute"),
                   recompute_ops=tuple(ops) if ops is not None else None,
                   recompute_modules=tuple(str(m) for m in modules) if modules is not None else None,
                   fp8_recipe=train.get("fp8_recipe"), fp8_all_gather=train.get("fp8_all_gather"), source=source,
                   stack=str(train.get("stack") or "shardlab"),
                   stack_settings=tuple((k, train[k]) for k in STACK_SETTINGS if train.get(k) is not None))

    def repertoire(self) -> Repertoire | None:
        """The schedules and recompute policies the stack's framework configures (None: every one)."""
        return STACKS[Stack(self.stack)].layouts

    def with_stack(self, stack: str | None, settings: dict[str, Any] | None = None) -> HeldTraining:
        """The same settings with another stack (None: keep) and these settings set on their own (added to, and
        replacing, the held ones; recompute_modules among them replaces the held modules)."""
        merged = {**dict(self.stack_settings), **{k: v for k, v in (settings or {}).items() if v is not None}}
        modules = merged.get("recompute_modules")
        return replace(self, stack=stack or self.stack,
                       stack_settings=tuple((k, merged[k]) for k in STACK_SETTINGS if k in merged),
                       recompute_modules=tuple(str(m) for m in modules) if modules else self.recompute_modules)

    def stack_memory(self, model: ModelSpec, device: str) -> StackMemory | None:
        """analytic/stack_memory.StackMemory of the held stack and settings (None for shardlab): the same settings
        `Layout.of` resolves from each planned spec."""
        from backend.analytic.stack_memory import stack_memory_of_train
        from backend.spec.train_spec import TrainSpec

        modules = {} if self.recompute_modules is None else {"recompute_modules": list(self.recompute_modules)}
        train = TrainSpec.model_validate({"precision": self.precision, "optimizer": self.optimizer,
                                          **self.spec_train("none"), **modules})
        return stack_memory_of_train(train, model, device)

    def problems(self) -> list[str]:
        """What the held settings contradict whatever the layout (spec/stack_rules.setting_problems: a dtype beside
        the precision, a Megatron-only setting on another stack), with the values; [] when every planned spec may
        carry them."""
        from backend.spec.stack_rules import setting_problems
        from backend.spec.train_spec import TrainSpec

        try:
            train = TrainSpec.model_validate({"precision": self.precision, "optimizer": self.optimizer,
                                              **self.spec_train("selective")})
        except ValueError as e:
            return [str(e)]
        return setting_problems(train)

    def engine_compile(self) -> EngineCompile:
        """What stack shardlab compiles (Layout.loss_compiled and blocks_compiled; a held loss parallel keeps the
        loss's eager terms, an upper bound on the tp = 1 layouts). Nothing for the other stacks."""
        from backend.analytic.stack_memory import NO_COMPILE, EngineCompile

        settings = dict(self.stack_settings)
        if self.stack != "shardlab":
            return NO_COMPILE
        return EngineCompile(loss=bool(settings.get("loss_compiled")) and not settings.get("loss_parallel"),
                             blocks=str(settings.get("elementwise") or "eager") == "compiled")

    def extra_recompute(self) -> tuple[tuple[str, int], ...]:
        """The held policy as (kind, K), for planner/space.enumerate_layouts (() when none is held)."""
        return (parse_recompute(self.recompute),) if self.recompute else ()

    def spec_train(self, recompute: str) -> dict[str, Any]:
        """The train fields every planned config's spec carries beyond the layout's own (recompute_ops only with op,
        recompute_modules only with selective)."""
        out: dict[str, Any] = {}
        if self.fp8_recipe is not None:
            out["fp8_recipe"] = self.fp8_recipe
        if self.fp8_all_gather is not None:
            out["fp8_all_gather"] = self.fp8_all_gather
        if self.recompute_ops is not None and recompute == "op":
            out["recompute_ops"] = list(self.recompute_ops)
        if self.recompute_modules is not None and recompute == "selective":
            out["recompute_modules"] = list(self.recompute_modules)
        if self.stack != "shardlab":
            out["stack"] = self.stack
        out.update(dict(self.stack_settings))
        return out

    def words(self) -> str:
        """The held settings, for the plan's notes."""
        parts = [f"precision {self.precision}", f"optimizer {self.optimizer}"]
        if self.precision == "fp8" and self.fp8_recipe:
            parts.append(f"fp8 recipe {self.fp8_recipe}" + ("" if self.fp8_all_gather is None else
                                                           ", float8 all-gather "
                                                           f"{'on' if self.fp8_all_gather else 'off'}"))
        if self.recompute:
            parts.append(f"recompute {self.recompute} searched besides the planner's policies")
        if self.recompute_modules is not None:
            parts.append("selective recompute of " + (", ".join(self.recompute_modules) or "no module"))
        parts.append(f"stack {self.stack}" + (" (" + ", ".join(f"{k} {_word(v)}" for k, v in self.stack_settings) + ")"
                                               if self.stack_settings else ""))
        return ", ".join(parts) + (f" (from {self.source})" if self.source else "")


def _word(value: Any) -> str:
    return ("on" if value else "off") if isinstance(value, bool) else str(value)
