"""diffusers <-> zoo for DiT (diffusers' DiTTransformer2DModel: config.json's `_class_name`,
weights in diffusion_pytorch_model.safetensors).

diffusers keeps a timestep embedder and a class table in every block (`transformer_blocks.i.
norm1.emb`), and its output layer reads block 0's; the paper's DiT, and the zoo, have one. Its
converted checkpoints (facebook/DiT-XL-2-256 ...) hold equal copies, so the zoo reads block 0's,
refuses a checkpoint whose copies differ, and writes a copy to every block (`keymap.tied`).
The patch Conv2d weight [D, C, p, p] becomes PatchEmbed's kernel [C * p * p, D]; Linear weights
are transposed; the fixed sin-cos positions are a buffer diffusers does not save either.
"""

import ml_collections

from nnx_zoo.common.errors import UserError
from nnx_zoo.common.keymap import copy, linear, patch_conv, tied, transpose
from nnx_zoo.zoo.dit import model as dit

MODEL_TYPES = ("DiTTransformer2DModel",)
PREFIX = ""
IGNORED = ()
WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"  # diffusers' name, not transformers'
ACTIVATIONS = {"gelu-approximate": "gelu", "gelu": "gelu_exact"}


def config_from_hf(hf: dict, names=()) -> ml_collections.ConfigDict:
  """The zoo model config of a DiTTransformer2DModel config.json."""
  del names
  if hf.get("norm_type", "ada_norm_zero") != "ada_norm_zero" or hf.get("norm_elementwise_affine"):
    raise UserError("Only DiT with norm_type='ada_norm_zero' and no norm affine is supported.")
  if not hf.get("attention_bias", True):
    raise UserError("DiT with attention_bias=False is not supported.")
  act = hf.get("activation_fn", "gelu-approximate")
  if act not in ACTIVATIONS:
    raise UserError(f"DiT with activation_fn={act!r} is not supported.")
  heads, head_dim = hf.get("num_attention_heads", 16), hf.get("attention_head_dim", 72)
  channels = hf.get("in_channels", 4)
  return dit.config(
    "tiny",  # every field of the preset is given below
    dim=heads * head_dim,
    num_layers=hf.get("num_layers", 28),
    num_heads=heads,
    image_size=hf.get("sample_size", 32),
    patch=hf.get("patch_size", 2),
    channels=channels,
    out_channels=hf.get("out_channels") or channels,
    num_classes=hf.get("num_embeds_ada_norm", 1000),
    norm_eps=1e-6,  # diffusers' AdaLayerNormZero and output norm: fixed
    mlp_norm_eps=hf.get("norm_eps", 1e-5),
    activation=ACTIVATIONS[act],
    freq_shift=1.0,
  )


def config_to_hf(cfg, model_type: str | None = None) -> dict:
  """config.json of a DiTTransformer2DModel; what it cannot express is refused."""
  del model_type
  att, cond = cfg.attention, cfg.conditioning
  mlp_eps = (cfg.mlp_norm or cfg.norm).eps
  acts = {v: k for k, v in ACTIVATIONS.items()}
  problems = []
  if cfg.norm.eps != 1e-6:
    problems.append(f"norm eps {cfg.norm.eps} (diffusers' adaLN norm has 1e-6)")
  if cond.freq_shift != 1.0 or cond.frequency_dim != 256 or cond.max_period != 10_000.0:
    problems.append("timestep features other than diffusers' (256, freq_shift 1, period 1e4)")
  if cfg.mlp.hidden_dim != 4 * cfg.dim or cfg.mlp.activation not in acts:
    problems.append(f"an MLP of {cfg.mlp.hidden_dim} {cfg.mlp.activation} (diffusers: 4 x dim)")
  if att.num_heads * att.head_dim != cfg.dim:
    problems.append("heads x head_dim != dim")
  if problems:
    raise UserError("diffusers' DiTTransformer2DModel cannot express " + "; ".join(problems))
  return {
    "_class_name": "DiTTransformer2DModel",
    "_diffusers_version": "0.30.0",
    "num_attention_heads": att.num_heads,
    "attention_head_dim": att.head_dim,
    "in_channels": cfg.channels,
    "out_channels": cfg.out_channels,
    "num_layers": cfg.num_layers,
    "dropout": 0.0,
    "norm_num_groups": 32,
    "attention_bias": True,
    "sample_size": cfg.image_size,
    "patch_size": cfg.patch,
    "activation_fn": acts[cfg.mlp.activation],
    "num_embeds_ada_norm": cond.num_classes,
    "upcast_attention": False,
    "norm_type": "ada_norm_zero",
    "norm_elementwise_affine": False,
    "norm_eps": mlp_eps,
  }


def rules(cfg) -> list:
  L = cfg.num_layers
  r = [
    patch_conv("pos_embed.proj.weight", "patch_embed.proj.kernel", patch=cfg.patch),
    copy("pos_embed.proj.bias", "patch_embed.proj.bias"),
    *linear("proj_out_1", "final_modulation.proj", bias=True),
    *linear("proj_out_2", "head", bias=True),
  ]
  emb = "norm1.emb"
  for theirs, ours in (("linear_1", "fc1"), ("linear_2", "fc2")):
    hf = f"{emb}.timestep_embedder.{theirs}"
    zoo = f"conditioning.timestep.{ours}"
    r.append(
      tied([transpose(f"transformer_blocks.{i}.{hf}.weight", f"{zoo}.kernel") for i in range(L)])
    )
    r.append(tied([copy(f"transformer_blocks.{i}.{hf}.bias", f"{zoo}.bias") for i in range(L)]))
  table = f"{emb}.class_embedder.embedding_table.weight"
  r.append(
    tied(
      [copy(f"transformer_blocks.{i}.{table}", "conditioning.label.embedding") for i in range(L)]
    )
  )
  for i in range(L):
    hf, zoo = f"transformer_blocks.{i}", f"blocks.{i}"
    r += linear(f"{hf}.norm1.linear", f"{zoo}.modulation.proj", bias=True)
    for x in "qkv":
      r += linear(f"{hf}.attn1.to_{x}", f"{zoo}.attn.{x}", bias=True)
    r += linear(f"{hf}.attn1.to_out.0", f"{zoo}.attn.o", bias=True)
    r += linear(f"{hf}.ff.net.0.proj", f"{zoo}.mlp.up", bias=True)
    r += linear(f"{hf}.ff.net.2", f"{zoo}.mlp.down", bias=True)
  return r
