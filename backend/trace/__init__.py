"""Full-scale traced memory: the engine's real set-up and train step on fake tensors over the fake
process group, per representative rank (rank.py in its own process), next to the analytic prediction
(run.py). Private torch APIs only in compat.py."""
