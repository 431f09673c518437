"""Models of other frameworks' own layouts: DeepSpeed ZeRO, JAX GSPMD, host offload."""
