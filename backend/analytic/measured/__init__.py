"""Post-processing of measurements: the bubble read off a pipeline timeline, the memory and traffic of a
measured MoE routing."""
