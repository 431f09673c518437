"""What torch.distributed.pipelining keeps and runs, as this engine uses it (pure Python): the stage inputs and
outputs a rank holds at its activation peak, and the interleaved-1F1B action order (schedules.py)."""

from __future__ import annotations


def held_stage_outputs(schedule: str, *, m: int, in_flight: int, stages: list[int], n_stages: int) -> int:
    """Stage outputs (one microbatch each) a rank keeps alive when its activations peak, for the stages that
    send to ANOTHER rank (a gloo send Work keeps its tensor until the Work object is dropped):
    gpipe: every forward's send Work sits in `fwd_sends_to_wait` until step() returns (schedules.py ScheduleGPipe);
    1f1b: the in-flight outputs in `fwd_cache` plus the warm-up send Work kept in `send_work` until the cooldown
    (schedules.py Schedule1F1B); interleaved / zero-bubble / zbv: `_PipelineScheduleRuntime` keeps every send
    Work in `send_ops` until the step ends, so each sending stage holds all m outputs. A stage whose successor
    is on the same rank (zbv's V turn) hands its output over as the next stage's input (`set_local_fwd_input`)."""
    senders = [s for s in stages if s != n_stages - 1 and s + 1 not in stages]
    if not senders:
        return 0
    if str(schedule) == "gpipe":
        return m
    if str(schedule) == "1f1b":
        return min(m, in_flight + 1)
    return m * len(senders)


def held_stage_inputs(*, m: int, stages: list[int]) -> int:
    """Stage inputs (one microbatch each) alive at the end of a step's forwards: every non-first stage keeps one
    input buffer per microbatch in `args_recv_info` for the whole step (stage.py `_setup_forward_recv_info`
    allocates them once; `set_local_fwd_input` rebinds them for a same-rank predecessor)."""
    return m * sum(s != 0 for s in stages)


def interleaved_order(p: int, v: int, m: int, rank: int) -> list[tuple[int, str]]:
    """(stage, "F" | "B") in the order pipeline rank `rank` runs them under interleaved 1F1B: torch's action list
    without its idle slots (torch/distributed/pipelining/schedules.py ScheduleInterleaved1F1B
    `_calculate_single_rank_operations`, `_get_warmup_ops`, `_get_1f1b_rank_ops`)."""
    per_round = m // max(1, m // p)  # schedules.py: microbatches_per_round = m // max(1, m // p)
    warmup = min((v - 1) * per_round + 2 * (p - 1 - rank), m * v)  # _get_warmup_ops(multiply_factor=2)
    steady = m * v - warmup

    def fwd(op: int) -> int:  # forward_stage_index
        return (op // per_round) % v * p + rank

    def bwd(op: int) -> int:  # backward_stage_index
        return (v - 1 - (op - warmup) // per_round % v) * p + rank

    out: list[tuple[int, str]] = []
    for op in range(warmup + steady + warmup):  # warm-up F, steady F then B, cool-down B
        if op < warmup + steady:
            out.append((fwd(op), "F"))
        if op >= warmup:
            out.append((bwd(op), "B"))
    return out
