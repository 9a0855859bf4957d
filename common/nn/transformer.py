"""The families' entry point to the shared transformer stacks: the config they are built from.

The stacks every family is are a Block (attention and MLP as residual sub-layers, their norms
placed by config, common/nn/block.py) and the Decoder and Encoder around a stack of blocks
(common/nn/decoder.py, encoder.py, stack.py), re-exported here.

A family's `model.py` gives presets and a `config()`; the model is `Decoder`, `Encoder`,
`EncoderDecoder` or `Denoiser`, and every choice that tells families apart is a config value.
`config` declares the keys every stack's blocks read; each stack's own keys are declared by its
builder, passed as `config(stack=...)`: `decoder_keys`, `encoder_keys`, `encoder_decoder_keys`,
`denoiser.denoiser_keys`, each with its default. A config saved before a key existed is read
with the key filled in (`nnx_zoo.common.models.upgrade`), so the layers index every key.

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
  not None, is the MLP's norm config where it differs from the attention's (diffusers' DiT);
- the Encoder's `inputs`: token ids (BERT, CLIP's text tower) or images cut into patches (ViT,
  CLIP's vision tower, see `patch_inputs`), and `pool_at`, the token a classifier or a
  projection reads (the first, or CLIP's end-of-text token).

`EncoderDecoder` (T5, Whisper) is two such stacks: an encoder (of tokens, or of feature frames
through a stem of 1-D convolutions, an audio front-end: see `frame_inputs`), and a decoder whose
blocks have a third sub-layer, cross-attention to the encoder's output (between self-attention
and the MLP, its norm placed by the same rule); see `EncoderDecoder` for its own keys.
"""

import ml_collections

from nnx_zoo.common.nn import lora

# transformer.py is the families' entry point: they build their configs here and name the stacks
# as `transformer.Decoder`, `transformer.Encoder`, ...; each lives in the module of its job.
from nnx_zoo.common.nn.block import Block, CrossCache
from nnx_zoo.common.nn.decoder import Decoder, decoder_keys
from nnx_zoo.common.nn.encoder import Encoder, encoder_keys, num_patches, patch_inputs
from nnx_zoo.common.nn.encoder_decoder import (
  EncoderDecoder,
  encoder_decoder_keys,
  frame_inputs,
  make_stem,
  num_frames_out,
  stem_segment_ids,
)
from nnx_zoo.common.nn.stack import StackKeys, layer_config

__all__ = [
  "Block",
  "CrossCache",
  "Decoder",
  "Encoder",
  "EncoderDecoder",
  "StackKeys",
  "config",
  "decoder_keys",
  "encoder_decoder_keys",
  "encoder_keys",
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
  stack: StackKeys,
  norm_placement: str = "pre",
  embed_scale: bool = False,
  layer_pattern: tuple[str, ...] = (),
  layer_kinds: dict | None = None,
  modulation: str = "none",
  mlp_norm: ml_collections.ConfigDict | None = None,
  init_std: float = 0.02,
) -> ml_collections.ConfigDict:
  """A model config: the keys every stack's blocks read, then `stack`, the keys of the stack
  the family is (from its builder: `decoder_keys`, `encoder_keys`, `encoder_decoder_keys` or
  `denoiser.denoiser_keys`). `mlp_norm`: the MLP's norm where it differs from `norm` (None:
  the same)."""
  if not isinstance(stack, StackKeys):
    raise TypeError(
      "transformer.config(stack=...) takes a stack's keys from its builder (decoder_keys, "
      "encoder_keys, encoder_decoder_keys, denoiser.denoiser_keys), not a dict."
    )
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
      "modulation": modulation,
      "mlp_norm": mlp_norm,
      # Stochastic depth in training: the rate at the last layer, rising from 0 at the first.
      "drop_path": 0.0,
      **stack,
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
