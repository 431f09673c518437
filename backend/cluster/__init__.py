"""Running experiments on a SLURM cluster: config (shardlab.toml [slurm]), the per-run batch script, the
squeue/scontrol/sbatch/scancel calls, and the runner the worker uses for `runtime.executor = "slurm"`."""
