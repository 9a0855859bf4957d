"""Whisper: an encoder-decoder speech recogniser. The encoder reads log-mel frames through two
1-D convolutions and pre-norm blocks; the decoder writes text tokens with cross-attention to it.

log-mel frames [B, T, mels] -> Conv1d(k=3) -> GELU -> Conv1d(k=3, stride 2) -> GELU
       -> + sinusoids -> [x + Attention(LayerNorm(x)) -> x + GELU MLP(LayerNorm(x))] x L
       -> LayerNorm -> the source [B, T / 2, D]
decoder tokens -> Embedding + learned positions
       -> [x + causal Attention(LayerNorm(x)) -> x + cross-Attention(LayerNorm(x), source)
           -> x + GELU MLP(LayerNorm(x))] x L_dec
       -> LayerNorm -> embedding^T (tied) -> logits

Attention has biases on q, v and the output but none on k (`attention.key_bias=False`); every
linear layer of the MLP has a bias; GELU is the exact one (HF's "gelu").
"""

import ml_collections

from nnx_zoo.common import config as config_lib
from nnx_zoo.common.nn import attention, mlp, norms, position, transformer

# Published dimensions (each openai/whisper-* config.json on the Hugging Face hub). Parameter
# counts, as transformers 5.25 counts WhisperForConditionalGeneration on the meta device (its
# encoder's fixed sinusoids, a frozen [1500, D] weight, included; the zoo computes them, so its
# own count is 1500 x D less: tests/zoo/whisper/test_whisper_model.py).
# fmt: off
AUDIO = dict(mels=80, audio_frames=3000, max_target_len=448, vocab_size=51865,
             decoder_start_id=50258)
PRESETS = {
    "whisper-tiny": dict(AUDIO, dim=384, num_layers=4, num_heads=6, hidden_dim=1536),
    "whisper-base": dict(AUDIO, dim=512, num_layers=6, num_heads=8, hidden_dim=2048),
    "whisper-small": dict(AUDIO, dim=768, num_layers=12, num_heads=12, hidden_dim=3072),
    "whisper-medium": dict(AUDIO, dim=1024, num_layers=24, num_heads=16, hidden_dim=4096),
    "whisper-large-v2": dict(AUDIO, dim=1280, num_layers=32, num_heads=20, hidden_dim=5120),
    "whisper-large-v3": dict(AUDIO, dim=1280, num_layers=32, num_heads=20, hidden_dim=5120,
                             mels=128, vocab_size=51866),
    # large-v3 with 4 decoder layers.
    "whisper-large-v3-turbo": dict(AUDIO, dim=1280, num_layers=32, num_heads=20, hidden_dim=5120,
                                   mels=128, vocab_size=51866, num_decoder_layers=4),
    # Tiny shapes for smoke runs and tests: 1 s of audio (100 frames), a byte-sized vocabulary.
    "tiny": dict(mels=80, audio_frames=100, max_target_len=32, vocab_size=64, dim=64,
                 num_layers=2, num_heads=4, hidden_dim=128, decoder_start_id=1),
}
# fmt: on
# transformers' counts of the published presets (see above).
HF_PARAMS = {
  "whisper-tiny": 37_760_640,
  "whisper-base": 72_593_920,
  "whisper-small": 241_734_912,
  "whisper-medium": 763_857_920,
  "whisper-large-v2": 1_543_304_960,
  "whisper-large-v3": 1_543_490_560,
  "whisper-large-v3-turbo": 808_878_080,
}


@config_lib.family_config(PRESETS, family="whisper")
def config(p: dict) -> ml_collections.ConfigDict:
  """The model config of a preset, with flat overrides: the keys of PRESETS' entries (mels: the
  log-mel bins; audio_frames: the frames of the longest input, 3000 = 30 s at 100 a second; the
  encoder sees half as many), and num_decoder_layers (num_layers), norm_eps (1e-5),
  decoder_start_id (50258, <|startoftranscript|>; the tiny preset's 1)."""
  frames = transformer.frame_inputs(channels=p["mels"], width=3, strides=(1, 2))
  H = p["dim"] // p["num_heads"]
  return transformer.config(
    family="whisper",
    vocab_size=p["vocab_size"],
    dim=p["dim"],
    num_layers=p["num_layers"],
    attention=attention.config(
      num_heads=p["num_heads"],
      head_dim=H,
      mask="bidirectional",
      qkv_bias=True,
      key_bias=False,
      out_bias=True,
    ),
    position=position.config(
      "sinusoidal", max_len=transformer.num_frames_out(frames, p["audio_frames"])
    ),
    norm=norms.config("layer", eps=p.get("norm_eps", 1e-5)),
    mlp=mlp.config("gelu_exact", hidden_dim=p["hidden_dim"], use_bias=True),
    norm_placement="pre",
    stack=transformer.encoder_decoder_keys(
      frames=frames,
      num_decoder_layers=p.get("num_decoder_layers", p["num_layers"]),
      decoder_position=position.config("learned", max_len=p["max_target_len"]),
      decoder_start_id=p["decoder_start_id"],
      shared_embeddings=True,
      tie_embeddings=True,
      output_scale="none",
    ),
  )


Model = transformer.EncoderDecoder
