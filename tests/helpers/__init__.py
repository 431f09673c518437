"""Helper modules of the test suite: launch helpers, torchrun rank programs, store fixtures, PostgreSQL and SLURM
servers."""
