"""torchtitan's MoE settings -> the spec's expert layout and MoE fields (job TOML and Trainer.Config dump).

From pytorch/torchtitan @ v0.2.2 (73a0e6979dd10b6b1904098eb3c8f62c18ab87ce):
- torchtitan/config/job_config.py class Parallelism: expert_parallel_degree (default 1, l. 454),
  expert_tensor_parallel_degree (default 1, l. 464: "[partial dp -> ep] etp = tp; [partial dp + all tp -> ep]
  etp = 1"), expert_parallel_comm_backend "standard" | "deepep" (l. 474; deepep -> model.moe_dispatcher flex, the
  DeepEP dispatch analytic/ep_dispatch.py models);
- torchtitan/distributed/parallel_dims.py l. 59: `assert etp == tp or etp == 1, "Currently we only support ETP=TP
  or ETP=1"` (when ep > 1); the sparse mesh (pp, dp_replicate, efsdp, ep, etp) with efsdp = fsdp x tp / (etp x ep)
  (l. 138): at etp 1 ep takes every tp rank;
- torchtitan/models/moe/moe.py class MoEArgs (l. 22-43): use_grouped_mm True (l. 37), load_balance_coeff 1e-3
  (l. 38: the aux-loss-free expert bias, no loss term), dropless (no capacity factor), all-to-all dispatch
  (distributed/expert_parallel.py ExpertParallel).
"""

from __future__ import annotations

from backend.importers.fields import Flat, Ignore, To, choice, positive_int

TABLE = {
    "parallelism.expert_parallel_degree": To("ep", positive_int),
    "parallelism.expert_tensor_parallel_degree": To("tt_etp", positive_int),
    "parallelism.expert_parallel_comm_backend": To("tt_ep_backend", choice({"standard": "standard",
                                                                              "deepep": "deepep"})),
    "parallelism.pipeline_parallel_expert_parallel_overlap": Ignore(
        "DualPipeV's overlap of one microbatch's all-to-all with another's compute: the dualpipev schedule's "
        "prediction overlaps them"),
}


def experts(flat: Flat) -> list[str]:
    """etp, the dispatcher and the MoE defaults torchtitan's MoE runs with; returns notes. Nothing for a dense model
    (torchtitan: "No effect for non-MoE models")."""
    ep, tp, etp = flat.get("ep", 1), flat.get("tp", 1), flat.get("tt_etp", 1)
    if not (flat.get("model_base") or {}).get("n_experts"):
        flat.canonical.pop("ep", None)
        return []
    flat.put("moe_grouped_gemm", True, "MoEArgs.use_grouped_mm (torchtitan's default)")
    deepep = flat.get("tt_ep_backend") == "deepep"
    if deepep:  # DeepEP's dispatch and combine: once per rank holding a token's experts, once per such node
        flat.put("moe_dispatcher", "flex", flat.source_of("tt_ep_backend"))
    notes = [f"torchtitan MoE: dropless, {'DeepEP' if deepep else 'all-to-all'} dispatch, grouped GEMMs "
             "(MoEArgs.use_grouped_mm), aux-loss-free load balancing (an expert bias, no loss term)"]
    if ep == 1:
        return notes
    if etp not in (1, tp):
        flat.problems.append(f"{flat.source_of('tt_etp')}={etp} with tensor_parallel_degree {tp}: torchtitan supports "
                             f"etp = tp ({tp}) or etp = 1 only (parallel_dims.py: \"Currently we only support ETP=TP "
                             "or "
                             "ETP=1\")")
        return notes
    flat.put("etp", etp, flat.source_of("tt_etp"))
    if etp == 1 and tp > 1:
        flat.unmap(flat.source_of("tt_etp"), etp, f"torchtitan's etp 1 with tp {tp} makes every tp rank part of ep "
                   "(ep % (cp x tp) == 0, efsdp = dp_shard x cp x tp / ep); ShardLab's ep spans dp x cp only: "
                   "predicted with ep over dp x cp and each expert whole on every tp rank (under FSDP, expert state tp "
                   "times torchtitan's)")
    return notes
