"""Training-log lines in the exact formats of torchtitan, Megatron-LM and DeepSpeed, written with the same format
strings as their sources (cited in backend/importers/log_*.py), for the issue-25 fixtures and their bad variants.

`python -m tests.helpers.import_logs` rewrites tests/fixtures/imports/*.log (deterministic: no clock, no randomness).
The numbers are plausible H100 figures chosen for the fixtures, not measurements.
"""

from __future__ import annotations

import math
from pathlib import Path

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "imports"


class Color:  # torchtitan/tools/utils.py Color
    red, green, yellow, blue, magenta, cyan = "\033[31m", "\033[32m", "\033[33m", "\033[34m", "\033[35m", "\033[36m"
    reset, orange, turquoise = "\033[39m", "\033[38;2;180;60;0m", "\033[38;2;54;234;195m"


def titan_prefix(second: int) -> str:
    """torchtitan/tools/logging.py: "[titan] %(asctime)s - %(name)s - %(levelname)s - %(message)s"."""
    return (f"[titan] 2025-06-20 10:{second // 60 % 60:02d}:{second % 60:02d},{(second * 37) % 1000:03d} "
            "- root - INFO - ")


def titan_metrics(step: int, loss: float, grad_norm: float, reserved_gib: float, capacity_gib: float, tps: float,
                  tflops: float, mfu: float) -> str:
    """components/metrics.py MetricsProcessor.log (mid-2025 and later, with grad_norm)."""
    c = Color
    return (f"{c.red}step: {step:2}  {c.green}loss: {loss:8.5f}  {c.orange}grad_norm: {grad_norm:7.4f}  "
            f"{c.turquoise}memory: {reserved_gib:5.2f}GiB({100 * reserved_gib / capacity_gib:.2f}%)  "
            f"{c.blue}tps: {round(tps):,}  {c.cyan}tflops: {tflops:,.2f}  {c.magenta}mfu: {mfu:.2f}%{c.reset}")


def torchtitan_log(steps: int = 100, *, tps: float = 5800.0, log_freq: int = 10, start: int = 1) -> list[str]:
    cap = 79.11
    lines = [titan_prefix(0) + "Starting job: Llama 3 8B training",
             titan_prefix(1) + f"CUDA capacity: NVIDIA H100 80GB HBM3 with {cap:.2f}GiB memory",
             titan_prefix(1) + "Building 1-D device mesh with ['dp_shard'], [8]",
             titan_prefix(2) + "Building llama3 8B with TransformerModelArgs(dim=4096, n_layers=32, n_heads=32, "
                               "n_kv_heads=8, vocab_size=128256, multiple_of=1024, ffn_dim_multiplier=1.3)",
             titan_prefix(3) + f"{Color.blue}Model llama3 8B {Color.red}size: 8,030,261,248 total "
                               f"parameters{Color.reset}",
             titan_prefix(4) + "Applied full activation checkpointing to the model",
             titan_prefix(5) + "Applied FSDP to the model",
             titan_prefix(6) + "Peak FLOPS used for computing MFU: 9.890e+14",
             titan_prefix(7) + "CUDA memory usage for model: 3.77GiB(4.77%)",
             titan_prefix(8) + f"Training starts at step {start}."]
    for step in range(start, steps + 1):
        if step != 1 and step % log_freq:
            continue
        warm = step == 1
        rate = tps * (0.18 if warm else 1.0 + 0.01 * math.sin(step))
        loss = 12.25 - 2.1 * math.log1p(step / 10)
        lines.append(titan_prefix(10 + step) + titan_metrics(step, loss, 1.5 + 1 / step, 63.21 if not warm else 51.70,
                                                             cap, rate, rate * 6 * 8.03e9 / 1e12 * 1.08,
                                                             rate * 6 * 8.03e9 * 1.08 / 9.89e12))
    lines.append(titan_prefix(10 + steps + 1) + "Sleeping 2 seconds for other ranks to complete")
    lines.append(titan_prefix(10 + steps + 3) + "Training completed")
    return lines


MEGATRON_ARGS = {  # a subset of the ~500 arguments megatron/training/arguments.py `_print_args` prints
    "num_layers": 80, "hidden_size": 8192, "num_attention_heads": 64, "group_query_attention": True,
    "num_query_groups": 8, "ffn_hidden_size": 28672, "seq_length": 4096, "max_position_embeddings": 4096,
    "micro_batch_size": 1, "global_batch_size": 256, "tensor_model_parallel_size": 8, "pipeline_model_parallel_size": 4,
    "context_parallel_size": 2, "data_parallel_size": 2, "world_size": 128, "sequence_parallel": True,
    "use_distributed_optimizer": True, "bf16": True, "fp16": False, "swiglu": True, "normalization": "RMSNorm",
    "position_embedding_type": "rope", "untie_embeddings_and_output_weights": True, "add_bias_linear": False,
    "padded_vocab_size": 32768, "recompute_granularity": "selective", "lr": 0.00015, "train_iters": 50,
    "log_interval": 1, "num_experts": None, "fp8": None, "params_dtype": "torch.bfloat16",
}


def megatron_iteration(it: int, total: int, ms: float, tflops: float, loss: float, second: int) -> str:
    """training.py training_log (2025+: timestamp, throughput with --log-throughput)."""
    s = f" [2026-03-01 10:{second // 60 % 60:02d}:{second % 60:02d}.{(it * 7919) % 1000000:06d}]"
    s += f" iteration {it:8d}/{total:8d} |"
    s += f" consumed samples: {it * 256:12d} |"
    s += f" elapsed time per iteration (ms): {ms:.1f} |"
    s += f" throughput per GPU (TFLOP/s/GPU): {tflops:.1f} |"
    s += f" learning rate: {1.5e-4 * min(1.0, it / 10):.6E} |"
    s += f" global batch size: {256:5d} |"
    s += f" lm loss: {loss:.6E} |"
    s += f" loss scale: {1.0:.1f} |"
    s += f" grad norm: {1.0 + 3 / it:.3f} |"
    s += f" number of skipped iterations: {0:3d} |"
    s += f" number of nan iterations: {0:3d} |"
    return s


def megatron_memory(rank: int, it: int, alloc: float, max_alloc: float, reserved: float, max_reserved: float) -> str:
    """utils report_memory: "[Rank r] (after N iterations) memory (MB) | allocated: ... | max reserved: ..."."""
    string = f"(after {it} iterations) memory (MB)"
    string += f" | allocated: {alloc:.2f}"
    string += f" | max allocated: {max_alloc:.2f}"
    string += f" | reserved: {reserved:.2f}"
    string += f" | max reserved: {max_reserved:.2f}"
    return f"[Rank {rank}] {string}"


def megatron_log(iters: int = 50, *, ms: float = 9120.0) -> list[str]:
    lines = ["using world size: 128, data-parallel size: 2, context-parallel size: 2, tensor-model-parallel size: 8, "
             "pipeline-model-parallel size: 4", "------------------------ arguments ------------------------"]
    for k in sorted(MEGATRON_ARGS, key=str.lower):
        lines.append("  {} {} {}".format(k, "." * (48 - len(k)), MEGATRON_ARGS[k]))
    lines += ["-------------------- end of arguments ---------------------", "> building Llama2Tokenizer tokenizer ...",
              "[after model, optimizer, and learning rate scheduler are built] datetime: 2026-03-01 09:58:01",
              "training ...", "[before the start of training step] datetime: 2026-03-01 09:58:40"]
    for it in range(1, iters + 1):
        t = ms * (2.6 if it == 1 else 1.0 + 0.004 * math.cos(it))
        lines.append(megatron_iteration(it, iters, t, 411.0 * ms / t, 10.4 - 1.3 * math.log1p(it), it * 9))
        if it in (1, 2):  # report_memory after the first and the second iteration (optimizer state allocated)
            for pp in range(4):
                for cp in range(2):
                    for tp in range(8):
                        rank = tp + 8 * cp + 32 * pp  # Megatron order tp-cp-dp-pp, data-parallel index 0
                        base = 36500.0 + 2100.0 * (3 - pp)
                        lines.append(megatron_memory(rank, it, base * 0.55, base + it * 900.0, base * 1.10 + 2048.0,
                                                     base * 1.10 + 2048.0 + it * 512.0))
    lines.append("[after training is done] datetime: 2026-03-01 10:06:12")
    return lines


def ds_prefix(second: int, where: str) -> str:
    """deepspeed/utils/logging.py: "[%(asctime)s] [%(levelname)s] [%(filename)s:%(lineno)d:%(funcName)s] "."""
    return f"[2026-03-02 11:{second // 60 % 60:02d}:{second % 60:02d},{(second * 53) % 1000:03d}] [INFO] [{where}] "


def deepspeed_log(steps: int = 40, *, gas: int = 4, step_ms: float = 5900.0, profile_step: int = 5) -> list[str]:
    lines = [ds_prefix(0, "real_accelerator.py:260:get_accelerator") + "Setting ds_accelerator to cuda (auto detect)",
             ds_prefix(1, "__init__.py:498:initialize") + "[Rank 0] DeepSpeed info: version=0.19.8, git-hash=unknown, "
                                                          "git-branch=unknown",
             ds_prefix(2, "config.py:674:print") + "DeepSpeedEngine configuration:"]
    fwd, bwd, opt = 0.31 * step_ms, 0.64 * step_ms, 0.05 * step_ms
    for step in range(1, steps + 1):
        slow = 1.9 if step == 1 else 1.0 + 0.005 * math.sin(step)
        for _ in range(gas):
            lines.append(f"[Rank 0] time (ms) | fwd_microstep: {fwd * slow / gas:.2f} | bwd_microstep: "
                         f"{bwd * slow / gas:.2f} | bwd_inner_microstep: {0.8 * bwd * slow / gas:.2f} "
                         f"| bwd_allreduce_microstep: {0.2 * bwd * slow / gas:.2f} | step_microstep: {0.0:.2f}")
        if step == profile_step:
            lines += _flops_profile(step, fwd * slow, bwd * slow, opt * slow)
        lines.append(f"[Rank 0] time (ms) | fwd: {fwd * slow:.2f} | bwd: {bwd * slow:.2f} | bwd_inner: "
                     f"{0.8 * bwd * slow:.2f} | bwd_allreduce: {0.2 * bwd * slow:.2f} | "
                     f"step: {opt * slow:.2f}")
        if step % 10 == 0:
            samples = 256 / ((fwd + bwd + opt) * slow / 1000)
            lines.append(ds_prefix(60 + step * 6, "logging.py:128:log_dist") + f"[Rank 0] step={step}, skipped=0, "
                         f"lr=[0.0003], mom=[(0.9, 0.95)]")
            lines.append(ds_prefix(60 + step * 6, "timer.py:264:stop")
                         + f"epoch=0/micro_step={step * gas}/global_step={step}, "
                         f"RunningAvgSamplesPerSec={samples * 0.998}, CurrSamplesPerSec={samples}, "
                         f"MemAllocated={14.21}GB, MaxMemAllocated={61.87}GB")
    return lines


def _flops_profile(step: int, fwd_ms: float, bwd_ms: float, opt_ms: float) -> list[str]:
    fmt = "{:<70}  {:<8}"
    it = (fwd_ms + bwd_ms + opt_ms) / 1000
    return ["", "-------------------------- DeepSpeed Flops Profiler --------------------------",
            f"Profile Summary at step {step}:", "Notations:",
            "data parallel size (dp_size), model parallel size(mp_size),", "",
            fmt.format("world size: ", 16), fmt.format("data parallel size: ", 16),
            fmt.format("model parallel size: ", 1), fmt.format("batch size per GPU: ", 4),
            fmt.format("params per GPU: ", "421.15 M"),
            fmt.format("params of model = params per GPU * mp_size: ", "421.15 M"),
            fmt.format("fwd MACs per GPU: ", "55.62 TMACs"), fmt.format("fwd flops per GPU: ", "111.25 T"),
            fmt.format("fwd latency: ", f"{fwd_ms / 1000:g} s"), fmt.format("bwd latency: ", f"{bwd_ms / 1000:g} s"),
            fmt.format("step latency: ", f"{opt_ms / 1000:g} s"), fmt.format("iter latency: ", f"{round(it, 2):g} s"),
            fmt.format("FLOPS per GPU = 3 * fwd flops per GPU / iter latency: ", f"{round(333.75 / it, 2):g} TFLOPS"),
            fmt.format("samples/second: ", round(4 * 16 / it, 2)), ""]


def write_fixtures() -> None:
    (FIX / "torchtitan_llama3_8b.log").write_text("\n".join(torchtitan_log()) + "\n")
    (FIX / "megatron_llama2_70b.log").write_text("\n".join(megatron_log()) + "\n")
    (FIX / "deepspeed_zero3.log").write_text("\n".join(deepspeed_log()) + "\n")


if __name__ == "__main__":
    write_fixtures()
