"""The human-readable report of one run: measured vs predicted memory per rank, speed, comm, loss parity."""

from __future__ import annotations

from pathlib import Path

from backend.result import (
    PARITY_FAILS,
    RankResult,
    RunResult,
    Status,
    parity_bound,
    parity_verdict,
    rank_step_s_median,
)

CATEGORIES = ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "peak_bytes")


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:.3f}"


def _pct(measured: float, predicted: float) -> str:
    return "-" if not predicted else f"{(measured - predicted) / predicted * 100:+.1f}%"


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
    out = ["  ".join(h.rjust(w) for h, w in zip(head, widths, strict=False))]
    out += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=False)) for r in rows]
    return out


def _memory_rows(ranks: list[RankResult], measured: bool) -> list[list[str]]:
    rows = []
    for r in ranks:
        for cat in CATEGORIES:
            m, p = getattr(r.measured, cat) if measured else None, getattr(r.predicted, cat)
            rows.append([str(r.rank), cat.removesuffix("_bytes"), _mib(m), _mib(p), "-" if m is None else _pct(m, p)])
    return rows


def _speed_lines(res: RunResult) -> list[str]:
    lines = []
    for r in res.per_rank:
        if (med := rank_step_s_median(r.step_s)) is not None:
            lines.append(f"rank {r.rank}: step median {med * 1e3:.1f} ms over {len(r.step_s)} timed steps")
    if res.step_s_median is not None:
        lines.append(f"step median {res.step_s_median * 1e3:.1f} ms, tokens/s "
                     f"{res.tokens_per_s:,.0f}" if res.tokens_per_s
                     else f"step median {res.step_s_median * 1e3:.1f} ms")
    if res.mfu is not None:
        lines.append(f"MFU {res.mfu * 100:.2f}%" + (f", HFU {res.hfu * 100:.2f}% (recompute included)"
                                                     if res.hfu is not None and res.hfu != res.mfu else ""))
    return lines


def _comm_lines(res: RunResult) -> list[str]:
    lines = []
    for r in res.per_rank:
        for kind, c in sorted(r.comm.items()):
            pred = r.comm_predicted.get(kind)
            vs = f" (predicted {_mib(pred)} MiB, {_pct(c.bytes, pred)})" if pred else ""
            lines.append(f"rank {r.rank} {kind}: {c.calls:.3g} calls, {_mib(c.bytes)} MiB payload{vs}, "
                         f"{'n/a' if c.seconds is None else f'{c.seconds * 1e3:.1f}'} ms / step")
    return lines


def _loss_lines(res: RunResult) -> list[str]:
    if not res.loss:
        return []
    lines = [f"loss: {res.loss[0]:.4f} -> {res.loss[-1]:.4f} over {len(res.loss)} steps"]
    if res.diverged_at is not None:
        lines.append(f"DIVERGED: the loss is {res.loss[res.diverged_at]} from step {res.diverged_at + 1} on")
    if res.loss_max_abs_diff is not None:
        precision = str(res.spec.train.precision)
        verdict = "FAILS" if parity_verdict(precision, res.loss_max_abs_diff) == PARITY_FAILS else "ok"
        lines.append(f"loss parity vs single-process reference: max |diff| = {res.loss_max_abs_diff:.2e}: {verdict} "
                     f"(bound {parity_bound(precision):g} for {precision})")
    return lines


def _framework_lines(res: RunResult) -> list[str]:
    """Issue 14: model states vs ShardLab's layout prediction and the framework's own estimate; offload split."""
    lines = []
    for r in res.per_rank:
        m, p, est, o = r.model_states_measured, r.model_states_predicted, r.framework_estimate, r.offload
        if m is not None and p is not None:
            line = (f"rank {r.rank} model states: {m.total_bytes:,} B measured, {p.total_bytes:,} B predicted "
                    f"({_pct(m.total_bytes, p.total_bytes)})")
            if est is not None:
                line += f"; DeepSpeed's estimate {est.device_bytes:,} B ({_pct(m.total_bytes, est.device_bytes)})"
            lines.append(line)
        if o is not None:
            lines.append(f"rank {r.rank} offload: host {o.host_bytes_measured:,} B measured / "
                         f"{o.host_bytes_predicted:,} B predicted, device {o.device_bytes_measured:,} / "
                         f"{o.device_bytes_predicted:,} B")
    return lines


def summary(res: RunResult, workdir: Path | None = None) -> str:
    p = res.spec.parallel
    head = f"run {res.status.value}: {p.strategy.value} world={p.world_size} (dp={p.dp} tp={p.tp} pp={p.pp} ep={p.ep})"
    if str(res.spec.framework) != "torch" or str(p.offload) != "none":  # issue 14
        head += f" [{res.spec.framework}, offload {p.offload}]"
    if res.wall_s is not None:
        head += f", wall {res.wall_s:.1f} s"
    lines = [head]
    if res.status != Status.OK:
        lines.append(f"error: {res.error}"
                     + (f" (failing rank {res.failing_rank})" if res.failing_rank is not None else ""))
        if res.traceback:
            lines += ["traceback (last lines):", *res.traceback.strip().splitlines()[-8:]]
    if res.per_rank:
        lines += ["", "memory at the step's peak (MiB):"]
        head = ["rank", "category", "measured", "predicted", "error"]
        lines += _table(head, _memory_rows(res.per_rank, res.memory_measured))
    for section in (_speed_lines(res), _comm_lines(res), _loss_lines(res), _framework_lines(res)):
        if section:
            lines += ["", *section]
    if res.notes:
        lines += ["", *(f"note: {n}" for n in res.notes)]
    if workdir is not None:
        lines.append(f"\nrun directory: {workdir}")
    return "\n".join(lines)
