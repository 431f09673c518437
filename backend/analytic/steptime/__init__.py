"""Step-time model: compute by op class, α–β collectives per link tier, overlap, pipeline schedule, optimizer.

Entry point: `model.step_time(spec, hardware)`; hardware profiles: `hardware.get_hardware(key)`.
"""
