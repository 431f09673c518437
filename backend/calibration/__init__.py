"""Calibration of the step-time model from stored measured runs: fit (fit.py), store and apply (store.py)."""
