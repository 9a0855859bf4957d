"""Shared parts of nnx-zoo: layers, config helpers, data, trainer, checkpoints and the CLI."""
