"""Hugging Face <-> zoo for T5 (`T5ForConditionalGeneration`, model_type `t5`): the original
T5, T5 v1.1 and FLAN-T5.

A torch Linear weight is [out, in], our kernel [in, out]: transposed. The relative position
table of each stack (`block.0...relative_attention_bias`, [buckets, N]) is copied as is.

Tying, as transformers 5.24 reads it: the config always says `tie_word_embeddings=True` and the
encoder, decoder and head share `shared.weight`, unless the checkpoint holds an `lm_head.weight`
of its own (v1.1, FLAN-T5), which is then kept apart: so the head is untied exactly when
`lm_head.weight` is there. The decoder output is scaled by d_model ** -0.5 before the head when
`scale_decoder_outputs` (written since 5.x) or, in older configs, unless
`tie_word_embeddings=False`.
"""

import ml_collections

from nnx_zoo.common import keymap
from nnx_zoo.common.errors import UserError
from nnx_zoo.common.keymap import copy, linear
from nnx_zoo.zoo.t5 import model as t5

MODEL_TYPES = ("t5",)
PREFIX = ""
# Copies of shared.weight (older saves), and a decoder cross-attention bias transformers itself
# drops on load (`_keys_to_ignore_on_load_unexpected`).
IGNORED = (
  r"^(encoder|decoder)\.embed_tokens\.weight$",
  r"^decoder\.block\.0\.layer\.1\.EncDecAttention\.relative_attention_bias\.weight$",
)
# (gated, transformers' dense_act_fn) -> our MLP activation.
ACTIVATIONS = {
  (False, "relu"): "relu",
  (True, "gelu_new"): "geglu",
  (True, "gelu_pytorch_tanh"): "geglu",
  (True, "silu"): "swiglu",
  (False, "gelu_new"): "gelu",
  (False, "gelu"): "gelu_exact",
}
# What config_to_hf writes for each activation (the first spelling above).
FEED_FORWARD = {"relu": "relu", "geglu": "gated-gelu", "swiglu": "gated-silu", "gelu": "gelu_new"}
FEED_FORWARD["gelu_exact"] = "gelu"


def _activation(proj: str) -> str:
  parts = proj.split("-")
  gated = parts[0] == "gated"
  act = parts[-1]
  if proj == "gated-gelu":  # transformers' alias: gelu_new, the tanh approximation
    act = "gelu_new"
  if (gated, act) not in ACTIVATIONS:
    raise UserError(f"T5 with feed_forward_proj={proj!r} is not supported.")
  return ACTIVATIONS[(gated, act)]


def config_from_hf(hf: dict, names=()) -> ml_collections.ConfigDict:
  """The zoo model config of a T5 config.json; `names` (the checkpoint's tensors) says whether
  the head is tied."""
  keymap.require(hf, ["vocab_size", "d_model", "d_kv", "d_ff", "num_layers", "num_heads"], "t5")
  if hf.get("is_encoder_decoder") is False:
    raise UserError("A T5 config with is_encoder_decoder=False is not supported.")
  scale = hf.get("scale_decoder_outputs")
  if scale is None:
    scale = hf.get("tie_word_embeddings", True) is not False
  start = hf.get("decoder_start_token_id")
  return t5.config(
    "tiny",  # every field of the preset is given below
    vocab_size=hf["vocab_size"],
    dim=hf["d_model"],
    num_layers=hf["num_layers"],
    num_decoder_layers=hf.get("num_decoder_layers") or hf["num_layers"],
    num_heads=hf["num_heads"],
    head_dim=hf["d_kv"],
    hidden_dim=hf["d_ff"],
    activation=_activation(hf.get("feed_forward_proj", "relu")),
    num_buckets=hf.get("relative_attention_num_buckets", 32),
    max_distance=hf.get("relative_attention_max_distance", 128),
    norm_eps=hf.get("layer_norm_epsilon", 1e-6),
    tie_embeddings="lm_head.weight" not in names,
    output_scale="rsqrt_dim" if scale else "none",
    decoder_start_id=start if start is not None else hf.get("pad_token_id") or 0,
  )


def config_to_hf(cfg, model_type: str | None = None) -> dict:
  """config.json of T5ForConditionalGeneration."""
  att = cfg.attention
  positions = (cfg.position.to_dict(), cfg.decoder_position.to_dict())
  same_buckets = {(p["num_buckets"], p["max_distance"]) for p in positions if "num_buckets" in p}
  if (
    not cfg.shared_embeddings
    or cfg.embed_scale
    or cfg.final_softcap
    or cfg.layer_pattern
    or cfg.norm_placement != "pre"
    or (cfg.norm.kind, cfg.norm.get("offset", 0.0)) != ("rms", 0.0)
    or cfg.mlp.kind != "dense"
    or cfg.mlp.use_bias
    or cfg.mlp.activation not in FEED_FORWARD
    or (att.mask, att.scale, att.window, att.softcap, att.qk_norm)
    != ("bidirectional", 1.0, 0, 0.0, "none")
    or att.qkv_bias
    or att.out_bias
    or att.num_kv_heads != att.num_heads
    or [p["kind"] for p in positions] != ["relative", "relative"]
    or [p["bidirectional"] for p in positions] != [True, False]
    or len(same_buckets) != 1
  ):
    raise UserError("This model has settings HF's T5 does not have: export it as its family.")
  return {
    "architectures": ["T5ForConditionalGeneration"],
    "model_type": "t5",
    "is_encoder_decoder": True,
    "vocab_size": cfg.vocab_size,
    "d_model": cfg.dim,
    "d_kv": att.head_dim,
    "d_ff": cfg.mlp.hidden_dim,
    "num_layers": cfg.num_layers,
    "num_decoder_layers": cfg.num_decoder_layers,
    "num_heads": att.num_heads,
    "relative_attention_num_buckets": cfg.position.num_buckets,
    "relative_attention_max_distance": cfg.position.max_distance,
    "layer_norm_epsilon": cfg.norm.eps,
    "feed_forward_proj": FEED_FORWARD[cfg.mlp.activation],
    # transformers 5 ties unless the checkpoint has its own lm_head.weight (written when
    # untied); False tells transformers 4.x the same.
    "tie_word_embeddings": bool(cfg.tie_embeddings),
    "scale_decoder_outputs": cfg.output_scale == "rsqrt_dim",
    "decoder_start_token_id": cfg.decoder_start_id,
    "torch_dtype": cfg.param_dtype,
  }


def rules(cfg) -> list:
  r = [copy("shared.weight", "embed.embedding")]
  if not cfg.shared_embeddings:
    r.append(copy("decoder.embed_tokens.weight", "decoder_embed.embedding"))
  if not cfg.tie_embeddings:
    r += linear("lm_head", "lm_head", bias=False)
  gated = cfg.mlp.activation in ("geglu", "swiglu")
  mlp = (
    (("wi_0", "gate"), ("wi_1", "up"), ("wo", "down")) if gated else (("wi", "up"), ("wo", "down"))
  )
  for side, num_layers in (("encoder", cfg.num_layers), ("decoder", cfg.num_decoder_layers)):
    r += [
      copy(
        f"{side}.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
        f"{side}.position.table",
      ),
      copy(f"{side}.final_layer_norm.weight", f"{side}.norm.scale"),
    ]
    for i in range(num_layers):
      hf, zoo = f"{side}.block.{i}.layer", f"{side}.blocks.{i}"
      r.append(copy(f"{hf}.0.layer_norm.weight", f"{zoo}.attn_norm.scale"))
      for x in "qkvo":
        r += linear(f"{hf}.0.SelfAttention.{x}", f"{zoo}.attn.{x}", bias=False)
      ff = 1
      if side == "decoder":  # layer.1 is cross-attention, the MLP moves to layer.2
        r.append(copy(f"{hf}.1.layer_norm.weight", f"{zoo}.cross_norm.scale"))
        for x in "qkvo":
          r += linear(f"{hf}.1.EncDecAttention.{x}", f"{zoo}.cross_attn.{x}", bias=False)
        ff = 2
      r.append(copy(f"{hf}.{ff}.layer_norm.weight", f"{zoo}.mlp_norm.scale"))
      for theirs, ours in mlp:
        r += linear(f"{hf}.{ff}.DenseReluDense.{theirs}", f"{zoo}.mlp.{ours}", bias=False)
  return r
