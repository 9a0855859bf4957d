"""Gemma 2 and Gemma 3 (text): decoders with norms on both sides of each sub-layer, scaled
embeddings, GeGLU, and a repeating pattern of sliding-window and global attention layers.

tokens -> Embedding x sqrt(D) -> [x + Norm(Attention(Norm(x))) -> x + Norm(GeGLU(Norm(x)))] x L
       -> Norm -> embedding^T (tied) -> soft-cap (Gemma 2) -> logits

Norms are RMSNorm in the x * (1 + w) form. Gemma 2: layers alternate sliding-window and global
attention, attention and final logits are soft-capped. Gemma 3: five sliding layers to one
global, QK-norm, no soft-caps, and the sliding layers have their own RoPE theta (10k; the
global ones 1M, scaled linearly by 8 from 4B up). The attention scale is
query_pre_attn_scalar ** -0.5.
"""

import ml_collections

from nnx_zoo.common import config as config_lib
from nnx_zoo.common.errors import UserError
from nnx_zoo.common.nn import attention, mlp, norms, position, transformer

# Published dimensions (each model's config.json on the Hugging Face hub; Gemma 3 4B and up:
# the text_config of the multimodal checkpoint).
# fmt: off
GEMMA2 = dict(
    version=2, attn_softcap=50.0, final_softcap=30.0, rope_theta=1e4, window=4096,
    query_pre_attn_scalar=256,
)
GEMMA3 = dict(
    version=3, rope_theta=1e6, local_rope_theta=1e4, window=1024, query_pre_attn_scalar=256,
    rope_scaling=dict(kind="linear", factor=8.0),
)
PRESETS = {
    "gemma2-2b": dict(GEMMA2, vocab_size=256000, dim=2304, num_layers=26, num_heads=8,
                      num_kv_heads=4, head_dim=256, hidden_dim=9216),
    "gemma2-9b": dict(GEMMA2, vocab_size=256000, dim=3584, num_layers=42, num_heads=16,
                      num_kv_heads=8, head_dim=256, hidden_dim=14336),
    "gemma2-27b": dict(GEMMA2, vocab_size=256000, dim=4608, num_layers=46, num_heads=32,
                       num_kv_heads=16, head_dim=128, hidden_dim=36864, query_pre_attn_scalar=144),
    "gemma3-1b": dict(GEMMA3, vocab_size=262144, dim=1152, num_layers=26, num_heads=4,
                      num_kv_heads=1, head_dim=256, hidden_dim=6912, window=512,
                      rope_scaling=dict(kind="none")),
    "gemma3-4b": dict(GEMMA3, vocab_size=262208, dim=2560, num_layers=34, num_heads=8,
                      num_kv_heads=4, head_dim=256, hidden_dim=10240),
    "gemma3-12b": dict(GEMMA3, vocab_size=262208, dim=3840, num_layers=48, num_heads=16,
                       num_kv_heads=8, head_dim=256, hidden_dim=15360),
    "gemma3-27b": dict(GEMMA3, vocab_size=262208, dim=5376, num_layers=62, num_heads=32,
                       num_kv_heads=16, head_dim=128, hidden_dim=21504, query_pre_attn_scalar=168),
    # Tiny shapes for smoke runs and tests (Gemma 2's arrangement).
    "tiny": dict(GEMMA2, vocab_size=256, dim=64, num_layers=4, num_heads=4, num_kv_heads=2,
                 head_dim=16, hidden_dim=128, window=8, query_pre_attn_scalar=16),
}
# fmt: on
# Gemma 2 alternates sliding and global layers; Gemma 3 has five sliding layers to one global.
PATTERNS = {2: ("sliding", "full"), 3: ("sliding",) * 5 + ("full",)}


@config_lib.family_config(PRESETS, family="gemma")
def config(p: dict) -> ml_collections.ConfigDict:
  """The model config of a preset, with flat overrides: the keys of PRESETS' entries (version
  2 or 3 picks the arrangement; local_rope_theta is Gemma 3's sliding layers' theta), and
  norm_eps (1e-6), layer_pattern (a tuple of "sliding"/"full")."""
  if p["version"] not in PATTERNS:
    raise UserError(f"gemma version {p['version']!r}: use 2 or 3.")
  scaling = position.rope_scaling(**p.get("rope_scaling", {"kind": "none"}))
  sliding = {"attention": {"window": p["window"]}}
  if p.get("local_rope_theta"):  # Gemma 3: the sliding layers' own RoPE, unscaled
    sliding["position"] = position.config("rope", theta=p["local_rope_theta"]).to_dict()
  return transformer.config(
    family="gemma",
    vocab_size=p["vocab_size"],
    dim=p["dim"],
    num_layers=p["num_layers"],
    attention=attention.config(
      num_heads=p["num_heads"],
      num_kv_heads=p["num_kv_heads"],
      head_dim=p["head_dim"],
      qk_norm="rms" if p["version"] == 3 else "none",
      softcap=p.get("attn_softcap", 0.0),
      scale=p["query_pre_attn_scalar"] ** -0.5,
    ),
    position=position.config("rope", theta=p["rope_theta"], scaling=scaling),
    norm=norms.config("rms", eps=p.get("norm_eps", 1e-6), offset=1.0),
    mlp=mlp.config("geglu", hidden_dim=p["hidden_dim"]),
    norm_placement="both",
    embed_scale=True,
    layer_pattern=p.get("layer_pattern", PATTERNS[p["version"]]),
    layer_kinds={"sliding": sliding, "full": {}},
    stack=transformer.decoder_keys(tie_embeddings=True, final_softcap=p.get("final_softcap", 0.0)),
  )


Model = transformer.Decoder
