"""Published formulas, each citing its paper and equation: ZeRO model states, collective volumes, FLOPs, the
pipeline bubble, the KV cache, the seed claims. They know nothing of this engine's placement."""
