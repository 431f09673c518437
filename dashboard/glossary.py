"""Plain words for the terms the pages show (column help and tooltips), in one place so every page says the same."""

from __future__ import annotations

from backend.spec.dims import SCHEDULE_WORDS

SCHEDULE_LABEL = SCHEDULE_WORDS

HELP = {
    "schedule": ("Pipeline schedule: GPipe (all forwards, then all backwards), 1F1B (one forward, one backward), "
                 "interleaved 1F1B (several stages per rank), zero bubble (backward split into input- and "
                 "weight-gradient passes, Qi et al. 2023), zero-bubble V (two stages per rank in a V shape)."),
    "virtual stages": "Pipeline stages each rank holds (interleaved schedules: its layers in v chunks; 1 otherwise).",
    "sequence parallel": ("Sequence parallel (SP): with tensor parallelism, the norm and dropout activations are split "
                          "along the sequence over the tensor-parallel ranks instead of replicated (Korthikanti et al. "
                          "2022)."),
    "context parallel": ("Context parallelism (CP): every sequence is split over cp ranks, each keeping its queries "
                         "and passing K/V round a ring of cp ranks (ring attention); activations shrink by cp, the cp "
                         "ranks share the parameters like data-parallel ranks (needs flash attention)."),
    "cp rotate": ("How K/V reach the other cp ranks: allgather (one all-gather per attention call, torch's default) or "
                  "alltoall (one hop round the ring per block, hidden behind that block's attention)."),
    "cp load balance": ("Head-tail chunks: cp rank r holds chunks r and 2cp-1-r of the sequence, so causal attention "
                        "costs every rank the same; without it the last rank does (2cp-1)/cp of the average."),
    "memory GiB": ("Worst rank's memory at its fullest moment, the number New experiment's fit check and `estimate` "
                   "give (GiB = 2^30 bytes; CUDA gives a process 79.1 GiB of an '80 GB' H100)."),
    "needs GiB": ("Memory at the fullest moment + the CUDA context, NCCL buffers and allocator slack: what must fit "
                  "the GPU's memory (the fit rule of New experiment and `estimate --hardware`, analytic/device.py)."),
    "fullest at": ("Which moment of the step is the worst rank's fullest: the end of forward (activation peak), the "
                   "start of the loss's backward, inside backward (the re-run block with its gradients; FSDP's "
                   "gathered parameters and reduce-scatter buffers) or optimizer.step."),
    "step s": "Predicted seconds per optimizer step on the slowest rank.",
    "step s (low)": "Low end of the predicted interval (the calibration's spread of errors; ±20% without a "
                    "calibration).",
    "step s (high)": "High end of the predicted interval (the calibration's spread of errors; ±20% without a "
                     "calibration).",
    "tokens/s": "Tokens per second of the whole job at the predicted step time.",
    "TFLOP/s per GPU": "Executed FLOPs per second per GPU, recompute included (Narayanan et al. 2021, Eq. 3).",
    "MFU %": "Model FLOPs utilization: model FLOPs per second (recompute not counted) / the GPUs' peak (PaLM, App. B).",
    "HFU": "Hardware FLOPs utilization: like MFU, but the recomputed forward passes count too.",
    "capacity factor": ("The expert capacity factor of the layout (Megatron's --moe-expert-capacity-factor): each rank "
                        "lets at most ceil(T·k/E × factor) of its tokens' slots reach one expert and drops the rest "
                        "(padded: every expert takes exactly that many rows). dropless: no limit. Dropping changes "
                        "what the model learns, not only its speed."),
    "dropped %": ("Routed token-slots the capacity limit drops, predicted under uniform routing (every expert gets "
                  "T·k/E): 0 for a factor >= 1. Real routing is uneven and drops more; a run counts its own."),
    "runs": "yes: this engine can run the layout (given as many ranks); prediction only: it can predict it, not run "
            "it.",
    "payload": "Payload: the size of the buffer handed to the collective.",
    "wire": ("Bytes on the wire: what a ring algorithm sends per rank for that payload: all-reduce 2(N-1)/N x payload; "
             "all-gather, reduce-scatter and all-to-all (N-1)/N x payload; send = payload."),
    "extrapolation": ("Why this prediction lies outside the runs its calibrated profile was fitted on (world size, "
                      "parameter count, link tier, strategy): expect a larger error than the leave-one-out error "
                      "there."),
    "K": ("K: optimizer-state bytes per parameter (Adam with mixed precision: fp32 master + momentum + variance = 12), "
          "on top of 2 bytes of parameters and 2 of gradients: 2 + 2 + K = 16 bytes per parameter without ZeRO."),
}


def schedule_label(schedule: str) -> str:
    return SCHEDULE_LABEL.get(schedule, schedule)
