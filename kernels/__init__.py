"""Pallas kernels, each with a pure-jnp reference and a CPU (interpret=True) test. None yet."""
