"""Diffusion experiments: denoisers trained and sampled by the one trainer."""
