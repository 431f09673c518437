"""The New-experiment form's widgets for the 2026 families' fields (issue 24), in five groups inside "Model family":
attention (own head width, q / k norm, sinks, sandwich norms, scaled embeddings), latent attention (MLA ranks and
head widths), windows (sliding / chunked, global layers, NoPE), MoE routing (scores, biases, groups, dense prefix,
interleave), and MoE capacity and dispatch (spec_form.MOE_RUN). Keys are the form's (`spec_form.MODEL_KEYS`, prefix
`f_`); 0 means None where the spec takes None."""

from __future__ import annotations

import streamlit as st

from dashboard import spec_form as sf

MAX_DIM = 1_000_000


def attention_inputs(prefix: str) -> None:
    st.markdown("**Attention**")
    c1, c2, c3 = st.columns(3)
    c1.number_input("head width (0 = h / a)", 0, MAX_DIM, key=prefix + "attn_head_dim",
                    help="Own q / k / v head width (Qwen3, Gemma 3, gpt-oss, Llama 4): q is a x this wide")
    c2.checkbox("q / k norm", key=prefix + "qk_norm", help="Per-head RMSNorm of q and k (Qwen3, Gemma 3)")
    c3.checkbox("attention sinks", key=prefix + "attention_sinks",
                help="A learned logit per head in every softmax (gpt-oss)")
    c1.checkbox("sandwich norms", key=prefix + "sandwich_norm", help="Norms after attention and MLP too (Gemma 2/3)")
    c2.checkbox("scaled embeddings", key=prefix + "scale_embeddings", help="Token embeddings times sqrt(h) (Gemma)")


def latent_attention_inputs(prefix: str) -> None:
    st.markdown("**Latent attention (MLA, DeepSeek-V2/V3)**")
    c1, c2, c3 = st.columns(3)
    c1.number_input("KV latent rank (0 = no MLA)", 0, MAX_DIM, key=prefix + "kv_lora_rank",
                    help="Width of the compressed KV latent cached per token (DeepSeek-V2 Sec 2.1)")
    c2.number_input("q latent rank (0 = direct q)", 0, MAX_DIM, key=prefix + "q_lora_rank")
    c3.number_input("v head width", 0, MAX_DIM, key=prefix + "v_head_dim")
    c1.number_input("q / k width without rope", 0, MAX_DIM, key=prefix + "qk_nope_head_dim")
    c2.number_input("rope width", 0, MAX_DIM, key=prefix + "qk_rope_head_dim",
                    help="Decoupled rotary part: per head for q, one shared key per token")


def window_inputs(prefix: str) -> None:
    st.markdown("**Windowed attention**")
    c1, c2, c3 = st.columns(3)
    c1.number_input("window (0 = none)", 0, 10_000_000, key=prefix + "window",
                    help="Keys a query sees (sliding) or the chunk length (chunked)")
    c2.selectbox("window kind", sf.FAMILY_CHOICES["window_kind"], key=prefix + "window_kind")
    c3.number_input("global every k-th layer (0 = none)", 0, 10_000, key=prefix + "global_every",
                    help="gpt-oss 2, Llama 4 4, Gemma 3 6: block i attends globally when (i + 1) % k == 0")
    c1.checkbox("global layers without rope (NoPE)", key=prefix + "global_layers_nope", help="Llama 4")


def routing_inputs(prefix: str) -> None:
    st.markdown("**MoE routing and layout**")
    c1, c2, c3 = st.columns(3)
    c1.selectbox("router scores", sf.FAMILY_CHOICES["router_score"], key=prefix + "router_score")
    c2.checkbox("router bias", key=prefix + "router_bias", help="The router Linear has a bias (gpt-oss)")
    c3.checkbox("balance bias", key=prefix + "router_balance_bias",
                help="DeepSeek-V3's per-expert bias for choosing experts, moved by load balancing (a buffer)")
    c1.number_input("expert groups", 1, 100_000, key=prefix + "expert_groups",
                    help="Group-limited routing: a token picks experts only from its best groups")
    c2.number_input("groups per token", 1, 100_000, key=prefix + "topk_groups")
    c3.number_input("dense blocks first", 0, 10_000, key=prefix + "first_dense_layers",
                    help="DeepSeek's first_k_dense_replace")
    c1.number_input("MoE every k-th block", 1, 10_000, key=prefix + "moe_every",
                    help="Qwen-MoE's decoder_sparse_step, Llama 4's interleave_moe_layer_step")


def moe_run_inputs(prefix: str) -> None:
    st.markdown("**MoE capacity and dispatch**")
    c1, c2, c3 = st.columns(3)
    c1.number_input("capacity factor (0 = dropless)", 0.0, 1_000.0, key=prefix + "capacity_factor", step=0.25,
                    help="Rows an expert takes per rank: factor x tokens x top-k / experts; the rest are dropped")
    c2.checkbox("pad to capacity", key=prefix + "moe_pad_to_capacity",
                help="Every expert takes exactly its capacity, padded (Megatron's --moe-pad-expert-input-to-capacity)")
    c3.selectbox("dispatcher", sf.FAMILY_CHOICES["moe_dispatcher"], key=prefix + "moe_dispatcher",
                 help="Megatron-Core's --moe-token-dispatcher-type under ep > 1: alltoall (the routed rows), allgather "
                      "(every token of the tp x ep group), flex (DeepEP / HybridEP: once per rank holding a token's "
                      "experts, once per such node across nodes); this engine runs alltoall, the others are predicted")
    c1.checkbox("grouped GEMM", key=prefix + "moe_grouped_gemm", help="All local experts in one grouped GEMM")
    c2.number_input("aux loss coefficient", 0.0, 1_000.0, key=prefix + "moe_aux_loss_coeff", step=0.001,
                    format="%.4f", help="The router's load-balancing loss, added to the training loss (0 = off)")
    c3.number_input("routing imbalance (prediction)", 1.0, 1_000.0, key=prefix + "moe_imbalance", step=0.1,
                    help="The busiest rank's expert load over the uniform load that the prediction assumes")


def family_2026_inputs(prefix: str) -> None:
    attention_inputs(prefix)
    latent_attention_inputs(prefix)
    window_inputs(prefix)
    routing_inputs(prefix)
    moe_run_inputs(prefix)
