"""Where weights come from and go to: zoo checkpoints (`checkpoint`), Hugging Face directories
(`hf`, with the key-map vocabulary of `keymap`), and the entry points below.

`nnx_zoo.common.hub.load(path)` is the Python entry point of docs/DESIGN.md: the NNX model with its
weights, from a zoo checkpoint or a Hugging Face directory.
"""

from nnx_zoo.common.hub.hf import family_of, fetch, params_module, read_hf, read_hf_config
from nnx_zoo.common.hub.weights import convert_hf, export_hf, load, read, read_zoo

__all__ = [
  "convert_hf",
  "export_hf",
  "family_of",
  "fetch",
  "load",
  "params_module",
  "read",
  "read_hf",
  "read_hf_config",
  "read_zoo",
]
