"""The families' entry point to the shared transformer stacks: the config they are built from.

The stacks every family is are a Block (attention and MLP as residual sub-layers, their norms
placed by config, common/nn/block.py) and the Decoder and Encoder around a stack of blocks
(common/nn/decoder.py, encoder.py, stack.py), re-exported here.

A family's `model.py` gives presets and a `config()`; the model is `Decoder` or `Encoder`, and
every choice that tells families apart is a config value:

- `norm_placement`: "pre" x + f(norm(x)) (Llama, GPT-2, ViT); "post" norm(x + f(x)) (BERT);
  "both" x + norm_out(f(norm_in(x))) (Gemma 2 and 3);
- `embed_scale`: token embeddings times sqrt(D) (Gemma); `final_softcap`: cap * tanh(logits /
  cap) on the output logits (Gemma 2), on every path that makes logits (`output_head`);
- `layer_pattern` and `layer_kinds`: a repeating pattern of layer kinds, each kind changing the
  attention (a sliding window) and/or the position encoding (its own RoPE theta) of its layers,
  e.g. Gemma 3's five local layers to one global; `model.scan` then stores the layers stacked
  per slot of the pattern and runs one scanned body per repetition of it;
- the sub-configs of attention, position, norm and MLP (`mlp.kind`: dense or MoE), each the
  shared layer's own config;
- `modulation`: "adaln_zero" modulates a pre-norm block by a conditioning vector c [B, D]
  (`cond_BD`): x + gate * f(norm(x) * (1 + scale) + shift) per sub-layer, shift, scale and gate
  from SiLU -> Linear(c) started at zero (DiT's adaLN-Zero, common/nn/conditioning.py); the
  `Denoiser` stack (common/nn/denoiser.py) gives c from a timestep and a class; `mlp_norm`, if
  given, is the MLP's norm config where it differs from the attention's (diffusers' DiT);
- the Encoder's `inputs`: token ids (BERT, CLIP's text tower), images cut into patches (ViT,
  CLIP's vision tower, see `patch_inputs`) or feature frames through a stem of 1-D convolutions
  (an audio front-end, see `frame_inputs`; so may an `EncoderDecoder`'s encoder), and
  `pool_at`, the token a classifier or a projection reads (the first, or CLIP's end-of-text
  token).

`EncoderDecoder` (T5) is two such stacks: an encoder, and a decoder whose blocks have a third
sub-layer, cross-attention to the encoder's output (`cross_attention`, between self-attention
and the MLP, its norm placed by the same rule); see `EncoderDecoder` for its own keys.
"""

import ml_collections

from nnx_zoo.common.nn import lora

# transformer.py is the families' entry point: they build their configs here and name the stacks
# as `transformer.Decoder`, `transformer.Encoder`, ...; each lives in the module of its job.
from nnx_zoo.common.nn.block import Block, CrossCache
from nnx_zoo.common.nn.decoder import Decoder
from nnx_zoo.common.nn.encoder import Encoder, make_stem, num_patches, stem_segment_ids
from nnx_zoo.common.nn.encoder_decoder import EncoderDecoder
from nnx_zoo.common.nn.patch import stem_length
from nnx_zoo.common.nn.stack import layer_config

__all__ = [
  "Block",
  "CrossCache",
  "Decoder",
  "Encoder",
  "EncoderDecoder",
  "config",
  "frame_inputs",
  "layer_config",
  "make_stem",
  "num_frames_out",
  "num_patches",
  "patch_inputs",
  "stem_segment_ids",
]


def config(
  *,
  family: str,
  vocab_size: int,
  dim: int,
  num_layers: int,
  attention: ml_collections.ConfigDict,
  position: ml_collections.ConfigDict,
  norm: ml_collections.ConfigDict,
  mlp: ml_collections.ConfigDict,
  norm_placement: str = "pre",
  embed_scale: bool = False,
  layer_pattern: tuple[str, ...] = (),
  layer_kinds: dict | None = None,
  init_std: float = 0.02,
  **extra,
) -> ml_collections.ConfigDict:
  """A model config for `Decoder` or `Encoder`: the shared keys, then the stack's own `extra`
  ones (Decoder: tie_embeddings, final_softcap; Encoder: type_vocab_size, embed_norm,
  final_norm, pooler, num_labels, pool_at (and end_token), and for images the keys of
  `patch_inputs`)."""
  return ml_collections.ConfigDict(
    {
      "family": family,
      "vocab_size": vocab_size,
      "dim": dim,
      "num_layers": num_layers,
      "attention": attention,
      "position": position,
      "norm": norm,
      "mlp": mlp,
      "norm_placement": norm_placement,
      "embed_scale": embed_scale,
      "layer_pattern": tuple(layer_pattern),
      "layer_kinds": layer_kinds or {},
      # Stochastic depth in training: the rate at the last layer, rising from 0 at the first.
      "drop_path": 0.0,
      **extra,
      "init_std": init_std,
      "remat": "none",  # or "full", "save_dots": recompute activations in the backward pass
      "scan": False,  # True: one compiled body (a repetition of the pattern) run by lax.scan
      # mesh.pipeline > 1: the times the micro-batches go round the stages, each stage holding
      # this many chunks of layers (circular, common/nn/pipeline.py).
      "pipeline_repeats": 1,
      # The projections of attention and the MLP multiplied in "int8" or "fp8" (common/nn/quant.py),
      # and with quant_backward their gradients' products too.
      "quant": "none",
      "quant_backward": True,
      "lora": lora.config(),  # rank > 0: low-rank adapters, base weights frozen
      "dtype": "float32",
      "param_dtype": "float32",
    }
  )


def patch_inputs(
  *,
  image_size: int,
  patch: int,
  channels: int = 3,
  patch_bias: bool = True,
  class_token: bool = True,
  pixel_mean: tuple[float, ...] = (0.5, 0.5, 0.5),
  pixel_std: tuple[float, ...] = (0.5, 0.5, 0.5),
) -> dict:
  """The `Encoder` keys of image inputs, to pass to `config(...)`: images [B, image_size,
  image_size, channels] in [0, 1], normalised as (x - pixel_mean) / pixel_std per channel (what
  a Hugging Face image processor does after scaling to [0, 1]), cut into patch x patch patches
  embedded by `PatchEmbed` (with a bias if `patch_bias`), after a learned class token if
  `class_token`. The learned positions need max_len = (image_size / patch)^2 + class_token."""
  return {
    "inputs": "patches",
    "image_size": image_size,
    "patch": patch,
    "channels": channels,
    "patch_bias": patch_bias,
    "class_token": class_token,
    "pixel_mean": tuple(pixel_mean),
    "pixel_std": tuple(pixel_std),
  }


def frame_inputs(
  *,
  channels: int,
  width: int = 3,
  strides: tuple[int, ...] = (1, 2),
  activation: str = "gelu_exact",
) -> dict:
  """The keys of an encoder whose inputs are feature frames [B, T, channels] (log-mel
  spectrograms: Whisper's 80 or 128 bins), to pass to `config(...)`: a `ConvStem` of one 1-D
  convolution of `width` taps per entry of `strides`, each followed by `activation` (an MLP
  activation's name), makes the encoder's T' = ~T / prod(strides) inputs."""
  return {
    "inputs": "frames",
    "channels": channels,
    "stem_width": width,
    "stem_strides": tuple(strides),
    "stem_activation": activation,
  }


def num_frames_out(cfg, frames: int) -> int:
  """The encoder's sequence length for `frames` input frames (a config with `frame_inputs`)."""
  return stem_length(frames, width=cfg["stem_width"], strides=cfg["stem_strides"])
