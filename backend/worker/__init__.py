"""The queue worker: claims queued runs from the store, runs them (locally or on SLURM), stores each result.

`service.Worker` is the loop (`python -m backend worker`); `job` runs one claimed job, `recovery` adopts what dead
workers left, `store_guard` rides out store outages, `lifetime` stops the process, `cleanup` is `python -m backend gc`
and a run's deletion with its folders."""
