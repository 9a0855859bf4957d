"""Hugging Face <-> zoo for BERT (BertModel; the encoder of BertFor* checkpoints, and the head of
BertForSequenceClassification when the model has one: model.num_labels).

A torch Linear weight is [out, in], our kernel [in, out]: transposed. q/k/v/o stay 2-D.
"""

import ml_collections

from nnx_zoo.common.errors import UserError
from nnx_zoo.common.keymap import copy, linear, plain_transformer_activation
from nnx_zoo.zoo.bert import model as bert

MODEL_TYPES = ("bert",)
PREFIX = "bert."
# The position-ids buffer, and the task heads of BertFor* checkpoints (pretraining, MLM, NSP,
# classification, QA), which the encoder does not have: dropped, and listed in `zoo convert`'s
# summary.
IGNORED = (r"(^|\.)embeddings\.position_ids$", r"^(cls|classifier|qa_outputs)\.")
# HF hidden_act -> our MLP kind.
ACTIVATIONS = {
  "gelu": "gelu_exact",
  "gelu_new": "gelu",
  "gelu_pytorch_tanh": "gelu",
  "relu": "relu",
}


def config_from_hf(hf: dict, names=()) -> ml_collections.ConfigDict:
  """The zoo model config of a BERT config.json; the pooler is there if the weights have it."""
  required = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"]
  missing = [k for k in required + ["intermediate_size"] if k not in hf]
  if missing:
    raise UserError(f"config.json (bert) lacks {missing}.")
  act = hf.get("hidden_act") or "gelu"
  problems = []
  if act not in ACTIVATIONS:
    problems.append(f"hidden_act={act!r}")
  if (hf.get("position_embedding_type") or "absolute") != "absolute":
    problems.append(f"position_embedding_type={hf['position_embedding_type']!r}")
  if hf.get("is_decoder") or hf.get("add_cross_attention"):
    problems.append("is_decoder or add_cross_attention")
  if problems:
    raise UserError(f"BERT with {', '.join(problems)} is not supported.")
  cfg = bert.config(
    "tiny",  # every field of the preset is given below
    vocab_size=hf["vocab_size"],
    dim=hf["hidden_size"],
    num_layers=hf["num_hidden_layers"],
    num_heads=hf["num_attention_heads"],
    hidden_dim=hf["intermediate_size"],
    max_len=hf.get("max_position_embeddings") or 512,
    type_vocab_size=hf.get("type_vocab_size") or 2,
    norm_eps=hf.get("layer_norm_eps") or 1e-12,
    activation=ACTIVATIONS[act],
    pooler=any(n.endswith("pooler.dense.weight") for n in names),
    num_labels=_num_labels(hf, names),
  )
  cfg.init_std = hf.get("initializer_range") or cfg.init_std
  return cfg


def _num_labels(hf: dict, names) -> int:
  if "BertForSequenceClassification" not in (hf.get("architectures") or []):
    return 0
  if "classifier.weight" not in names:
    raise UserError("config.json says BertForSequenceClassification but has no classifier.weight.")
  return hf.get("num_labels") or len(hf.get("id2label") or {}) or 2


def config_to_hf(cfg, model_type: str | None = None) -> dict:
  """config.json; one architecture, so `model_type` is always "bert"."""
  act = plain_transformer_activation(cfg, ACTIVATIONS, "BERT")
  att = cfg.attention
  num_labels = cfg.num_labels
  # Without a pooler, BertModel still loads (it initialises one: the hidden states are the same).
  return {
    "architectures": ["BertForSequenceClassification" if num_labels else "BertModel"],
    **({"num_labels": num_labels} if num_labels else {}),
    "model_type": "bert",
    "vocab_size": cfg.vocab_size,
    "hidden_size": cfg.dim,
    "num_hidden_layers": cfg.num_layers,
    "num_attention_heads": att.num_heads,
    "intermediate_size": cfg.mlp.hidden_dim,
    "hidden_act": act,
    "max_position_embeddings": cfg.position.max_len,
    "type_vocab_size": cfg.type_vocab_size,
    "layer_norm_eps": cfg.norm.eps,
    "position_embedding_type": "absolute",
    "initializer_range": cfg.init_std,
    "torch_dtype": cfg.param_dtype,
  }


def rules(cfg) -> list:
  # A classifier's encoder weights are named as BertForSequenceClassification's: under "bert.".
  head = cfg.num_labels
  p = PREFIX if head else ""
  e = f"{p}embeddings"
  r = [
    copy(f"{e}.word_embeddings.weight", "embed.embedding"),
    copy(f"{e}.position_embeddings.weight", "position.embedding"),
    copy(f"{e}.token_type_embeddings.weight", "token_type.embedding"),
    copy(f"{e}.LayerNorm.weight", "embed_norm.scale"),
    copy(f"{e}.LayerNorm.bias", "embed_norm.bias"),
  ]
  if cfg.pooler:
    r += linear(f"{p}pooler.dense", "pooler", bias=True)
  if head:
    r += linear("classifier", "head", bias=True)
  for i in range(cfg.num_layers):
    hf, zoo = f"{p}encoder.layer.{i}", f"blocks.{i}"
    for theirs, ours in (("query", "q"), ("key", "k"), ("value", "v")):
      r += linear(f"{hf}.attention.self.{theirs}", f"{zoo}.attn.{ours}", bias=True)
    r += linear(f"{hf}.attention.output.dense", f"{zoo}.attn.o", bias=True)
    r += linear(f"{hf}.intermediate.dense", f"{zoo}.mlp.up", bias=True)
    r += linear(f"{hf}.output.dense", f"{zoo}.mlp.down", bias=True)
    for hf_norm, ours in (
      (f"{hf}.attention.output.LayerNorm", "attn_norm"),
      (f"{hf}.output.LayerNorm", "mlp_norm"),
    ):
      r += [
        copy(f"{hf_norm}.weight", f"{zoo}.{ours}.scale"),
        copy(f"{hf_norm}.bias", f"{zoo}.{ours}.bias"),
      ]
  return r
