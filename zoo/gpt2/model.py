"""GPT-2: a pre-norm decoder with learned absolute positions, LayerNorm, a GELU MLP, biases
everywhere and the output projection tied to the token embedding.

tokens -> Embedding + learned positions -> [LayerNorm -> Attention -> + -> LayerNorm -> GELU MLP
       -> +] x L -> LayerNorm -> embedding^T (tied) -> logits
"""

import ml_collections

from nnx_zoo.common import config as config_lib
from nnx_zoo.common.nn import attention, mlp, norms, position, transformer

# Published dimensions (openai-community/gpt2* config.json on the Hugging Face hub).
# fmt: off
PRESETS = {
    "gpt2": dict(vocab_size=50257, dim=768, num_layers=12, num_heads=12, max_len=1024),
    "gpt2-medium": dict(vocab_size=50257, dim=1024, num_layers=24, num_heads=16, max_len=1024),
    "gpt2-large": dict(vocab_size=50257, dim=1280, num_layers=36, num_heads=20, max_len=1024),
    "gpt2-xl": dict(vocab_size=50257, dim=1600, num_layers=48, num_heads=25, max_len=1024),
    # Tiny shapes for smoke runs and tests.
    "tiny": dict(vocab_size=256, dim=64, num_layers=2, num_heads=4, max_len=128),
}
# fmt: on


@config_lib.family_config(PRESETS, family="gpt2")
def config(p: dict) -> ml_collections.ConfigDict:
  """The model config of a preset, with flat overrides: the keys of PRESETS' entries, and
  hidden_dim (4 * dim), norm_eps (1e-5), activation ("gelu", GPT-2's gelu_new), tie_embeddings
  (True)."""
  return transformer.config(
    family="gpt2",
    vocab_size=p["vocab_size"],
    dim=p["dim"],
    num_layers=p["num_layers"],
    attention=attention.config(
      num_heads=p["num_heads"], head_dim=p["dim"] // p["num_heads"], qkv_bias=True, out_bias=True
    ),
    position=position.config("learned", max_len=p["max_len"]),
    norm=norms.config("layer", eps=p.get("norm_eps", 1e-5)),
    mlp=mlp.config(
      p.get("activation", "gelu"), hidden_dim=p.get("hidden_dim", 4 * p["dim"]), use_bias=True
    ),
    stack=transformer.decoder_keys(tie_embeddings=p.get("tie_embeddings", True)),
  )


Model = transformer.Decoder
