"""The exact memory model of this engine, for one layout or arrays of them (the prediction core):
parts.py (a rank's parameters as block / embedding / head sums), model_state.py (params, grads, optimizer),
zero1_share.py, fsdp_state.py (FSDP2's unsharded state at the peak), activations.py (per block, pure formulas),
rank_activations.py (per rank), moe_bytes.py (EP MoE saved bytes), rank.py (`rank_memory`, `worst_rank_memory`),
backward_moment.py (the fullest moment inside backward; pipelined_backward.py: a pipelined stage's terms),
state_floor.py (a lower bound of `worst_rank_memory`, the planner's prune)."""
