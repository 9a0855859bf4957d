"""Where weights come from and go to: zoo checkpoints (`checkpoint`), Hugging Face directories
(`hf`, with the key-map vocabulary of `keymap`), llama.cpp's GGUF files (`gguf`), and the entry
points below.

`nnx_zoo.common.hub.load(path)` is the Python entry point of docs/DESIGN.md: the NNX model with its
weights, from a zoo checkpoint, a Hugging Face directory or a GGUF file.
"""

from nnx_zoo.common.hub.gguf import read_gguf
from nnx_zoo.common.hub.hf import family_of, fetch, params_module, read_hf, read_hf_config
from nnx_zoo.common.hub.weights import (
  convert_gguf,
  convert_hf,
  export_gguf,
  export_hf,
  load,
  read,
  read_zoo,
)

__all__ = [
  "convert_gguf",
  "convert_hf",
  "export_gguf",
  "export_hf",
  "family_of",
  "fetch",
  "load",
  "params_module",
  "read",
  "read_gguf",
  "read_hf",
  "read_hf_config",
  "read_zoo",
]
