"""Published end-to-end GPU training throughput as evidence for the step-time model (pure Python, no torch).

`published_gpu.json` beside this module holds the rows: each quotes its source verbatim (`quote`, `url`) and
says which ShardLab experiment it is (`spec`, with `{"preset": name}` allowed for the model) and what the
source measured (`published`: tokens/s of the whole job, tokens/s per GPU, or the iteration time). Narayanan
et al. 2021 Table 1 rows come from `published.PTDP_TABLE1` (TFLOP/s per GPU, Eq. 3 FLOPs).

These rows are the TEST of the model, never its training set: no hardware value is fitted to them
(benchmarks/published_gpu.py prints predicted against published; tests/unit/test_published_gpu.py pins Korthikanti
2022 Table 5).

Each row's spec carries the stack its source ran (`train.stack`, spec/stacks.py) and every stack setting the source
states (attention kernel, element-wise, fp8, overlaps...) as spec fields: the row is predicted through exactly the
settings a person has (`estimate --spec` on the row's spec prints the same step time). A row's older top-level
`attention` / `implementation` (what the run used) are written into its spec as attention_kernel / elementwise.
`published.memory_gib` is the source's peak memory where it gives one (printed beside the step time).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from backend.analytic.steptime.published import PTDP_TABLE1, SEQ, VOCAB, ptdp_spec_dict
from backend.analytic.textbook.flops import megatron_flops_per_iteration, narayanan_flops_per_iteration
from backend.presets import preset_model

DATA_FILE = Path(__file__).with_name("published_gpu.json")
PTDP_URL = "https://arxiv.org/abs/2104.04473"


@dataclass(frozen=True)
class PublishedRow:
    id: str
    group: str
    """Hardware generation of the source: H100 or A100."""
    hardware: str
    """ShardLab hardware profile the row is predicted on."""
    source: str
    url: str
    quote: str
    layout: str
    spec: dict[str, Any]
    """ShardLab experiment spec (model preset expanded)."""
    step_s: float
    """Published seconds per optimizer step (derived from the published number, `derivation` says how)."""
    derivation: str
    attention: str = "flash"
    implementation: str | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)
    memory_gib: float | None = None
    """The source's published peak memory per GPU (GiB; torchtitan: max reserved), None where it gives none."""

    @property
    def stack(self) -> str:
        return str(self.spec.get("train", {}).get("stack", "shardlab"))


def _model(model: dict[str, Any]) -> dict[str, Any]:
    if "preset" not in model:
        return model
    base = preset_model(model["preset"])
    return {**base, **{k: v for k, v in model.items() if k != "preset"}}


def _step_s(row: dict[str, Any]) -> tuple[float, str]:
    pub = row["published"]
    metric, value = pub["metric"], float(pub["value"])
    if metric == "tokens_per_s":
        return pub["tokens_per_step"] / value, f"{pub['tokens_per_step']} tokens per step / {value:g} tokens/s"
    if metric == "tokens_per_s_per_gpu":
        return pub["tokens_per_step"] / (value * pub["gpus"]), (f"{pub['tokens_per_step']} tokens per step / "
                                                                f"({value:g} tokens/s per GPU x {pub['gpus']} GPUs)")
    if metric == "iteration_s":
        return value, "published iteration time"
    if metric == "tflops_per_gpu_megatron":  # Megatron-LM's logged TFLOP/s: its own FLOPs count per iteration
        m = _model(row["spec"]["model"])
        flops = megatron_flops_per_iteration(
            batch=row["spec"]["train"]["global_batch"], seq=m["seq_len"], layers=m["n_layers"], hidden=m["d_model"],
            heads=m["n_heads"], kv_heads=m.get("n_kv_heads") or m["n_heads"],
            ffn=m.get("ffn_hidden") or 4 * m["d_model"], vocab=m["vocab_size"], gated=m.get("mlp", "gelu") != "gelu")
        return flops / (value * 1e12 * pub["gpus"]), (f"Megatron's FLOPs per iteration {flops:.4g} (training.py "
                                                      f"num_floating_point_operations) / ({value:g} TFLOP/s x "
                                                      f"{pub['gpus']} GPUs)")
    raise ValueError(f"row {row['id']}: unknown published metric {metric!r}")


KERNEL_SETTING = {"flash": "flash2", "eager": "eager", "flash-triton": "flash-triton", "flash1": "flash1",
                  "cudnn": "cudnn", "efficient": "efficient", "flash3": "flash3"}
"""A row's `attention` (the step-time model's kernel names) -> the spec's attention_kernel."""
ELEMENTWISE_SETTING = {"fused": "fused", "torch": "eager", "compiled": "compiled"}


def row_spec(row: dict[str, Any]) -> dict[str, Any]:
    """The row's spec with its model preset expanded and the kernels the run used written as stack settings."""
    train = dict(row["spec"].get("train", {}))
    model = _model(row["spec"]["model"])
    if "attention" in row and "attention_kernel" not in train:
        train["attention_kernel"] = KERNEL_SETTING[row["attention"]]
        if row["attention"] != "eager" and "attention" not in model:  # a fused kernel saves no s x s scores
            model = {**model, "attention": "flash"}
    if row.get("implementation") and "elementwise" not in train:
        train["elementwise"] = ELEMENTWISE_SETTING[row["implementation"]]
    return {**row["spec"], "model": model, "train": train}


def _from_json(row: dict[str, Any]) -> PublishedRow:
    spec = row_spec(row)
    step_s, how = _step_s(row)
    return PublishedRow(id=row["id"], group=row["group"], hardware=row["hardware"], source=row["source"],
                        url=row["url"], quote=row["quote"], layout=row["layout"], spec=spec, step_s=step_s,
                        derivation=how, attention=row.get("attention", "flash"),
                        implementation=row.get("implementation"), notes=tuple(row.get("notes", ())),
                        memory_gib=row["published"].get("memory_gib"))


def _ptdp(row: tuple) -> PublishedRow:
    params_b, heads, h, layers, t, p, gpus, batch, tflops = row
    flops = narayanan_flops_per_iteration(B=batch, s=SEQ, l=layers, h=h, V=VOCAB)
    spec = ptdp_spec_dict(row)
    spec["train"].update(stack="megatron", attention_kernel="eager")  # Megatron-LM 2021: no FlashAttention
    return PublishedRow(id=f"ptdp-t1-{params_b}B", group="A100", hardware="a100-80gb-sxm",
                        source="Narayanan et al. 2021 (SC'21), Table 1 (Selene, DGX A100 80GB)", url=PTDP_URL,
                        quote=f"{params_b}B: {heads} heads, hidden {h}, {layers} layers, TP {t}, PP {p}, {gpus} GPUs, "
                              f"batch {batch}, {tflops} TFLOP/s per GPU",
                        layout=f"TP {t} x PP {p} x DP {gpus // (t * p)} + full recompute", spec=spec,
                        step_s=flops / (tflops * 1e12 * gpus),
                        derivation="Eq. 3 FLOPs per iteration / (published TFLOP/s per GPU x GPUs)", attention="eager",
                        implementation="fused",
                        notes=("b = 1 and non-interleaved 1F1B assumed (Table 1 gives neither)",
                               "stack megatron (Megatron-LM 2021: fused kernels, fused Adam, vocab-parallel loss), "
                               "attention eager (no FlashAttention then)"))


@lru_cache(maxsize=1)
def published_rows() -> tuple[PublishedRow, ...]:
    """Every published row: the data file's, then Narayanan 2021 Table 1."""
    data = json.loads(DATA_FILE.read_text())
    return tuple(_from_json(r) for r in data["rows"]) + tuple(_ptdp(r) for r in PTDP_TABLE1)


def raw_rows() -> list[dict[str, Any]]:
    """The data file's rows as stored (quotes, columns, published numbers), for checks against the quotes."""
    return json.loads(DATA_FILE.read_text())["rows"]
