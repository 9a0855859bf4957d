"""T5: an encoder-decoder of pre-norm blocks with RMS norms, unscaled attention and learned
relative position biases; the original T5 (ReLU, a tied head fed D ** -0.5 times the decoder's
output) and T5 v1.1 / FLAN-T5 (gated GELU, an untied head).

tokens -> Embedding -> [x + Attention(RMSNorm(x), bias) -> x + MLP(RMSNorm(x))] x L
       -> RMSNorm -> the source [B, S, D]
decoder tokens -> the same Embedding
       -> [x + causal Attention(RMSNorm(x), bias) -> x + cross-Attention(RMSNorm(x), source)
           -> x + MLP(RMSNorm(x))] x L_dec
       -> RMSNorm -> (x D ** -0.5: original T5) -> embedding^T (tied) or lm_head -> logits

The bias is one table per stack (transformers keeps it in the first layer), bidirectional in the
encoder and causal in the decoder; cross-attention has none. The MLP is ReLU (original) or
GELU-tanh gated ("gated-gelu", transformers' gelu_new: our "geglu").
"""

import ml_collections

from nnx_zoo.common import config as config_lib
from nnx_zoo.common.nn import attention, mlp, norms, position, transformer

# Published dimensions (each model's config.json on the Hugging Face hub). Parameter counts, as
# transformers counts them on the meta device: t5-small 60,506,624 (tied); t5-v1.1-small and
# flan-t5-small 76,961,152 with their checkpoints' separate lm_head (transformers 5 builds a
# fresh model from the config alone with a tied one, 60,511,616).
# fmt: off
V11 = dict(activation="geglu", tie_embeddings=False)
PRESETS = {
    "t5-small": dict(vocab_size=32128, dim=512, num_layers=6, num_heads=8, head_dim=64,
                     hidden_dim=2048, activation="relu", tie_embeddings=True),
    "t5-v1.1-small": dict(V11, vocab_size=32128, dim=512, num_layers=8, num_heads=6, head_dim=64,
                          hidden_dim=1024),
    "flan-t5-small": dict(V11, vocab_size=32128, dim=512, num_layers=8, num_heads=6, head_dim=64,
                          hidden_dim=1024),
    # Tiny shapes for smoke runs and tests (v1.1's arrangement).
    "tiny": dict(V11, vocab_size=256, dim=64, num_layers=2, num_heads=4, head_dim=16,
                 hidden_dim=128, num_buckets=16, max_distance=32),
}
# fmt: on


@config_lib.family_config(PRESETS, family="t5")
def config(p: dict) -> ml_collections.ConfigDict:
  """The model config of a preset, with flat overrides: the keys of PRESETS' entries, and
  num_decoder_layers (num_layers), num_buckets (32), max_distance (128), norm_eps (1e-6),
  output_scale ("rsqrt_dim" if tie_embeddings, else "none": transformers'
  scale_decoder_outputs), decoder_start_id (0, T5's pad id)."""

  def relative(bidirectional: bool):
    return position.config(
      "relative",
      num_buckets=p.get("num_buckets", 32),
      max_distance=p.get("max_distance", 128),
      bidirectional=bidirectional,
    )

  return transformer.config(
    family="t5",
    vocab_size=p["vocab_size"],
    dim=p["dim"],
    num_layers=p["num_layers"],
    attention=attention.config(
      num_heads=p["num_heads"], head_dim=p["head_dim"], mask="bidirectional", scale=1.0
    ),
    position=relative(True),
    norm=norms.config("rms", eps=p.get("norm_eps", 1e-6)),
    mlp=mlp.config(p["activation"], hidden_dim=p["hidden_dim"]),
    stack=transformer.encoder_decoder_keys(
      num_decoder_layers=p.get("num_decoder_layers", p["num_layers"]),
      decoder_position=relative(False),
      decoder_start_id=p.get("decoder_start_id", 0),
      shared_embeddings=True,
      tie_embeddings=p["tie_embeddings"],
      output_scale=p.get("output_scale", "rsqrt_dim" if p["tie_embeddings"] else "none"),
    ),
  )


Model = transformer.EncoderDecoder
