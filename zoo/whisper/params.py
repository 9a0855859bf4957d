"""Hugging Face <-> zoo for Whisper (`WhisperForConditionalGeneration`, model_type `whisper`).

A torch Linear weight is [out, in], our kernel [in, out]: transposed. The two Conv1d weights
[D, C, 3] become the conv stem's kernels [C * 3, D]. transformers stores the encoder's sinusoids
as a frozen weight (`embed_positions.weight`); the zoo computes them, so import checks the
stored table is those sinusoids and export writes it. The head (`proj_out`) is the decoder's
embedding (tied), as every published Whisper.
"""

import ml_collections

from nnx_zoo.common import keymap
from nnx_zoo.common.errors import UserError
from nnx_zoo.common.keymap import copy, linear
from nnx_zoo.common.nn import position
from nnx_zoo.zoo.whisper import model as whisper

MODEL_TYPES = ("whisper",)
PREFIX = "model."
IGNORED = (r"^proj_out\.weight$",)  # a tied copy of the decoder's embed_tokens


def config_from_hf(hf: dict, names=()) -> ml_collections.ConfigDict:
  """The zoo model config of a Whisper config.json."""
  keymap.require(
    hf,
    ["vocab_size", "num_mel_bins", "d_model", "encoder_layers", "decoder_layers"],
    "whisper",
  )
  problems = []
  for ours, theirs in (
    ("encoder_attention_heads", "decoder_attention_heads"),
    ("encoder_ffn_dim", "decoder_ffn_dim"),
  ):
    if hf.get(ours) != hf.get(theirs):
      problems.append(f"{ours}={hf.get(ours)} != {theirs}={hf.get(theirs)}")
  for key, fine in (
    ("activation_function", "gelu"),
    ("scale_embedding", False),
    ("tie_word_embeddings", True),
  ):
    if hf.get(key, fine) != fine:
      problems.append(f"{key}={hf[key]!r}")
  if "proj_out.weight" in names:
    problems.append("an untied proj_out.weight")
  if problems:
    raise UserError(f"Whisper with {', '.join(problems)} is not supported.")
  start = hf.get("decoder_start_token_id")
  return whisper.config(
    "tiny",  # every field of the preset is given below
    mels=hf["num_mel_bins"],
    audio_frames=2 * hf.get("max_source_positions", 1500),
    max_target_len=hf.get("max_target_positions", 448),
    vocab_size=hf["vocab_size"],
    dim=hf["d_model"],
    num_layers=hf["encoder_layers"],
    num_decoder_layers=hf["decoder_layers"],
    num_heads=hf.get("encoder_attention_heads", 6),
    hidden_dim=hf.get("encoder_ffn_dim", 4 * hf["d_model"]),
    decoder_start_id=50257 if start is None else start,
  )


def config_to_hf(cfg, model_type: str | None = None) -> dict:
  """config.json of WhisperForConditionalGeneration."""
  att = cfg.attention
  if (
    cfg.get("inputs") != "frames"
    or (cfg.stem_width, tuple(cfg.stem_strides), cfg.stem_activation) != (3, (1, 2), "gelu_exact")
    or not (cfg.shared_embeddings and cfg.tie_embeddings)
    or cfg.embed_scale
    or cfg.output_scale != "none"
    or cfg.get("final_softcap", 0.0)
    or cfg.layer_pattern
    or cfg.norm_placement != "pre"
    or cfg.norm.kind != "layer"
    or (cfg.mlp.kind, cfg.mlp.activation, cfg.mlp.use_bias) != ("dense", "gelu_exact", True)
    or (att.qkv_bias, att.get("key_bias", True), att.out_bias) != (True, False, True)
    or (att.mask, att.window, att.softcap, att.qk_norm) != ("bidirectional", 0, 0.0, "none")
    or att.scale not in (0.0, att.head_dim**-0.5)
    or att.num_kv_heads != att.num_heads
    or att.num_heads * att.head_dim != cfg.dim
    or (cfg.position.kind, cfg.position.theta) != ("sinusoidal", 10_000.0)
    or cfg.decoder_position.kind != "learned"
  ):
    raise UserError("This model has settings HF's Whisper does not have: export it as its family.")
  return {
    "architectures": ["WhisperForConditionalGeneration"],
    "model_type": "whisper",
    "is_encoder_decoder": True,
    "vocab_size": cfg.vocab_size,
    "num_mel_bins": cfg.channels,
    "d_model": cfg.dim,
    "encoder_layers": cfg.num_layers,
    "decoder_layers": cfg.num_decoder_layers,
    "encoder_attention_heads": att.num_heads,
    "decoder_attention_heads": att.num_heads,
    "encoder_ffn_dim": cfg.mlp.hidden_dim,
    "decoder_ffn_dim": cfg.mlp.hidden_dim,
    "activation_function": "gelu",
    "max_source_positions": cfg.position.max_len,
    "max_target_positions": cfg.decoder_position.max_len,
    "scale_embedding": False,
    "tie_word_embeddings": True,
    "decoder_start_token_id": cfg.decoder_start_id,
    "torch_dtype": cfg.param_dtype,
  }


def _attention(hf: str, zoo: str) -> list:
  r = []
  for x in "qv":
    r += linear(f"{hf}.{x}_proj", f"{zoo}.{x}", bias=True)
  r += linear(f"{hf}.k_proj", f"{zoo}.k", bias=False)
  return r + linear(f"{hf}.out_proj", f"{zoo}.o", bias=True)


def _norm(hf: str, zoo: str) -> list:
  return [copy(f"{hf}.weight", f"{zoo}.scale"), copy(f"{hf}.bias", f"{zoo}.bias")]


def rules(cfg) -> list:
  table = position.Sinusoidal(cfg.position.max_len, cfg.dim, theta=cfg.position.theta).table
  r = [
    *keymap.conv1d("model.encoder.conv1", "stem.convs.0", width=cfg.stem_width),
    *keymap.conv1d("model.encoder.conv2", "stem.convs.1", width=cfg.stem_width),
    keymap.fixed("model.encoder.embed_positions.weight", table, what="Whisper's sinusoids"),
    *_norm("model.encoder.layer_norm", "encoder.norm"),
    copy("model.decoder.embed_tokens.weight", "embed.embedding"),
    copy("model.decoder.embed_positions.weight", "decoder.position.embedding"),
    *_norm("model.decoder.layer_norm", "decoder.norm"),
  ]
  for side, num_layers in (("encoder", cfg.num_layers), ("decoder", cfg.num_decoder_layers)):
    for i in range(num_layers):
      hf, zoo = f"model.{side}.layers.{i}", f"{side}.blocks.{i}"
      r += _norm(f"{hf}.self_attn_layer_norm", f"{zoo}.attn_norm")
      r += _attention(f"{hf}.self_attn", f"{zoo}.attn")
      if side == "decoder":
        r += _norm(f"{hf}.encoder_attn_layer_norm", f"{zoo}.cross_norm")
        r += _attention(f"{hf}.encoder_attn", f"{zoo}.cross_attn")
      r += _norm(f"{hf}.final_layer_norm", f"{zoo}.mlp_norm")
      r += linear(f"{hf}.fc1", f"{zoo}.mlp.up", bias=True)
      r += linear(f"{hf}.fc2", f"{zoo}.mlp.down", bias=True)
  return r


def decoder_prompt(generation: dict, *, language: str | None, task: str | None) -> list[int]:
  """Whisper's decoder prompt from its generation_config.json, as transformers' `generate`
  writes it for up to 30 s of audio without timestamps: <|startoftranscript|>, the language
  (`--language`: a code, en, or its token, <|en|>), the task (transcribe or translate),
  <|notimestamps|>. A multilingual checkpoint defaults to its config's forced language and task,
  else to English and transcribe (transformers would detect the language instead); an
  English-only one (no `lang_to_id`) writes <|startoftranscript|> <|notimestamps|>."""
  prompt = [generation["decoder_start_token_id"]]
  languages = generation.get("lang_to_id") or {}
  tasks = generation.get("task_to_id") or {}
  forced = keymap.forced_tokens(generation)
  if not generation.get("is_multilingual", bool(languages)):
    if language not in (None, "en", "<|en|>") or task not in (None, "transcribe"):
      raise UserError(
        "This Whisper checkpoint is English-only: it transcribes English and takes no other "
        "--language or --task."
      )
    prompt += [t for t in forced if t is not None]
  elif language is None and task is None and forced and forced[0] is not None:
    prompt += forced  # a fine-tuned checkpoint's own language and task
  else:
    language = language or generation.get("language") or "en"
    token = language if language.startswith("<|") else f"<|{language.lower()}|>"
    if token not in languages:
      codes = ", ".join(sorted(t.strip("<|>") for t in languages))
      raise UserError(f"Unknown --language {language!r}: this checkpoint knows {codes}.")
    task = task or generation.get("task") or "transcribe"
    if task not in tasks:
      raise UserError(f"Unknown --task {task!r}: give {' or '.join(sorted(tasks))}.")
    prompt += [languages[token], tasks[task]]
  no_timestamps = generation.get("no_timestamps_token_id")
  if no_timestamps is not None and prompt[-1] != no_timestamps:
    prompt.append(no_timestamps)
  return prompt
