"""Pallas kernels, each with a pure-jnp reference and a CPU (interpret=True) test:
flash_attention, used by the shared attention layer when `model.attention.impl="flash"`."""
