"""What torch.compile changes on CPU ranks (issue 34 part 4): step time of whole engine runs, eager against compiled
blocks and loss, side by side; and what one block keeps for backward, eager against compiled, each next to the
model's prediction.

  .venv/bin/python benchmarks/compile_cpu.py [--rounds 3] [--steps 6] [--out benchmarks/results/compile_cpu.json]

Step time: the same spec (stack torchtitan, zero3 at world 2 on gloo, a small Llama-shaped model) runs through the
engine (`run_experiment`) with elementwise eager and compiled, alternating per round, so a load burst hits both
alike; the ratio of each round's medians and the median of those ratios are reported. The first warm-up step holds
the compile (not timed).
Saved bytes: one block, in this process, with saved_tensors_hooks counting each storage autograd keeps (parameters
left out), eager and under torch.compile, against activations.layer_activation_bytes (eager) and
memory/compiled_block.compiled_block_bytes (compiled).

Where CPU and GPU differ: Inductor writes C++ / OpenMP kernels here and Triton kernels on a GPU, so the step-time
ratio measured here says nothing about a GPU's (the step-time model times compiled element-wise work from its bytes
and kernel count: steptime/elementwise.py); the saved tensors come from the same FX partition on both.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from backend.launch.launcher import run_experiment  # noqa: E402
from backend.spec import ExperimentSpec  # noqa: E402

MODEL = {"vocab_size": 1024, "d_model": 256, "n_layers": 4, "n_heads": 8, "n_kv_heads": 4, "seq_len": 256,
         "norm": "rmsnorm", "mlp": "swiglu", "positions": "rope", "bias": "none", "attention": "flash",
         "tie_embeddings": False}


def run_spec(elementwise: str, steps: int) -> ExperimentSpec:
    return ExperimentSpec.model_validate({
        "name": f"compile-cpu {elementwise}", "model": MODEL,
        "train": {"global_batch": 8, "micro_batch": 2, "steps": steps, "warmup_steps": 2, "precision": "bf16-mixed",
                  "stack": "torchtitan", "elementwise": elementwise},
        "parallel": {"strategy": "zero3", "world_size": 2}, "runtime": {"device": "cpu", "timeout_s": 900}})


def step_median(elementwise: str, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        res = run_experiment(run_spec(elementwise, steps), workdir=Path(tmp))
    if res.status != "ok":
        raise RuntimeError(f"{elementwise} run {res.status}: {res.error}")
    return {"step_s_median": res.step_s_median, "loss_last": res.loss[-1],
            "activations_bytes_rank0": res.per_rank[0].measured.activations_bytes}


def saved_bytes(compiled: bool) -> int:
    """Bytes autograd keeps for one block's backward (bf16, micro-batch 2), each storage once, parameters left out."""
    import torch

    from backend.models.gpt import build_model

    spec = run_spec("eager", 1).model
    block = build_model(spec, seed=0).to(torch.bfloat16).layers["0"]
    run = torch.compile(block) if compiled else block
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}

    def x():
        return torch.randn(2, spec.seq_len, spec.d_model, dtype=torch.bfloat16, requires_grad=True)

    run(x()).sum().backward()  # compiles
    saved: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run(x())
    return sum(saved.values())


def predicted_block_bytes() -> dict:
    from backend.analytic.memory.activations import LayerShape, layer_activation_bytes
    from backend.analytic.memory.compiled_block import compiled_block_bytes

    shape = LayerShape.prototype(run_spec("eager", 1).model, dtype_bytes=2, device="cpu")
    from dataclasses import replace

    shape = replace(shape, micro_batch=2, autocast=False)
    return {"eager": layer_activation_bytes(shape, "none"), "compiled": compiled_block_bytes(shape)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "compile_cpu.json")
    args = ap.parse_args()
    rounds = []
    for k in range(args.rounds):
        order = ("eager", "compiled") if k % 2 == 0 else ("compiled", "eager")
        got = {e: step_median(e, args.steps) for e in order}
        got["ratio_compiled_over_eager"] = got["compiled"]["step_s_median"] / got["eager"]["step_s_median"]
        rounds.append(got)
        print(f"round {k + 1}: eager {got['eager']['step_s_median'] * 1e3:.1f} ms, compiled "
              f"{got['compiled']['step_s_median'] * 1e3:.1f} ms, ratio {got['ratio_compiled_over_eager']:.3f}",
              flush=True)
    measured = {"eager": saved_bytes(False), "compiled": saved_bytes(True)}
    predicted = predicted_block_bytes()
    out = {"spec": json.loads(run_spec("compiled", args.steps).to_json()), "rounds": rounds,
           "median_ratio_compiled_over_eager": statistics.median(r["ratio_compiled_over_eager"] for r in rounds),
           "block_saved_bytes": {"measured": measured, "predicted": predicted},
           "notes": [__doc__.split("Where CPU and GPU differ: ")[1].strip().replace("\n", " ")]}
    print(f"median ratio compiled / eager step: {out['median_ratio_compiled_over_eager']:.3f}")
    print(f"one block saves (bf16, mb 2): eager {measured['eager']:,} B (predicted {predicted['eager']:,.0f}), "
          f"compiled {measured['compiled']:,} B (predicted {predicted['compiled']:,.0f})")
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
