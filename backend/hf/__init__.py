"""Hugging Face config.json reading: the key reads, the families, the ModelSpec they make."""
