"""What every rank program (torch engine, DeepSpeed, JAX) and its launcher share: the typed file protocol
(`protocol.py`), the one `rank_main` (`entry.py`), test fault injection (`faults.py`) and the process-group
timeout (`timeouts.py`). Imports nothing of the engine, the frameworks or the launcher: both sides import it."""
