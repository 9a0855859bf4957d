"""GGUF files (llama.cpp's format) <-> zoo checkpoints, through the families' Hugging Face key maps.

A GGUF file is read as the Hugging Face checkpoint it was converted from: its metadata becomes
the config.json dict, its tensors (dequantized by the `gguf` library) take their HF names and
layouts, and the family's own `config_from_hf` and `rules` (zoo/<family>/params.py, through
`hf.from_hf`) do the rest. Writing runs the same way backwards from `hf.to_hf`. So there is one
copy of each layout rule:

- tensor names: the `gguf` library's own table (`gguf.get_tensor_name_map`, llama.cpp's
  `tensor_mapping.py`), which maps HF names to GGUF names per architecture;
- metadata keys: `CONFIG_KEYS` below, read and written;
- the value transforms llama.cpp applies on top of renaming: `PERMUTED_QK` (Llama's q/k rows in
  llama.cpp's rotary layout, `LlamaModel.permute` of convert_hf_to_gguf.py) and `NORM_OFFSET`
  (Gemma's norm weights stored as w + 1), applied by `_to_hf` and `_to_gguf`.
"""

import importlib.util
import json
import os

import numpy as np

from nnx_zoo.common.errors import UserError
from nnx_zoo.common.hub import hf

# GGUF `general.architecture` -> HF model_type (Mistral and SmolLM files are "llama").
ARCHS = {
  "llama": "llama",
  "qwen2": "qwen2",
  "qwen3": "qwen3",
  "gemma2": "gemma2",
  "gemma3": "gemma3_text",
}
MODEL_TYPES = {"mistral": "llama", **{v: k for k, v in ARCHS.items()}}  # HF -> GGUF arch
# llama.cpp permutes q and k rows of "llama" files for its rotary layout (`LlamaModel.permute`);
# Qwen's and Gemma's files keep HF's (NEOX) layout.
PERMUTED_QK = ("llama",)
# llama.cpp stores Gemma's RMSNorm weights (x * (1 + w)) as w + 1.
NORM_OFFSET = {"gemma2": 1.0, "gemma3": 1.0}
# `{arch}.KEY` metadata <-> config.json field, and the GGUF value type it is written as.
CONFIG_KEYS = (
  ("context_length", "max_position_embeddings", "uint32"),
  ("embedding_length", "hidden_size", "uint32"),
  ("block_count", "num_hidden_layers", "uint32"),
  ("feed_forward_length", "intermediate_size", "uint32"),
  ("attention.head_count", "num_attention_heads", "uint32"),
  ("attention.head_count_kv", "num_key_value_heads", "uint32"),
  ("attention.key_length", "head_dim", "uint32"),
  ("attention.layer_norm_rms_epsilon", "rms_norm_eps", "float32"),
  ("rope.freq_base", "rope_theta", "float32"),
  ("vocab_size", "vocab_size", "uint32"),
  ("attention.sliding_window", "sliding_window", "uint32"),
  ("attn_logit_softcapping", "attn_logit_softcapping", "float32"),
  ("final_logit_softcapping", "final_logit_softcapping", "float32"),
)
# Tensors llama.cpp writes that no HF checkpoint has: Llama 3's RoPE frequency factors (which
# transformers' GGUF reader drops as well; the model then runs with plain RoPE).
DROPPED = ("rope_freqs.weight",)
# The tokenizer's per-token lists: left out of `read_gguf`'s info.
TOKEN_LISTS = (
  "tokenizer.ggml.tokens",
  "tokenizer.ggml.token_type",
  "tokenizer.ggml.merges",
  "tokenizer.ggml.scores",
)
EXPORT_TYPES = ("f32", "f16", "bf16", "q8_0")
CONTEXT_LENGTH = 8192  # written when the model config names none
DEQUANT_CHUNK = 1 << 20  # values a tensor is dequantized by at a time (`GGUFTensors.get`)


def _supported() -> str:
  return ", ".join(ARCHS)


# Reading


def _open(path: str):
  import gguf

  if not os.path.isfile(path):
    raise UserError(f"{path!r} is not a file: give a .gguf file.")
  with open(path, "rb") as f:
    magic = f.read(4)
  if magic != b"GGUF":
    raise UserError(f"{path} is not a GGUF file (it does not start with the GGUF magic).")
  try:
    return gguf.GGUFReader(path)
  except Exception as e:  # a truncated or damaged file fails anywhere in the reader
    raise UserError(
      f"{path} is not a readable GGUF file, truncated or damaged ({type(e).__name__}: "
      f"{str(e)[:120]})."
    ) from None


def _fields(reader) -> dict:
  return {k: f.contents() for k, f in reader.fields.items()}


def _arch(meta: dict, path: str) -> str:
  arch = meta.get("general.architecture")
  if arch not in ARCHS:
    raise UserError(
      f"{path} holds a {arch!r} model: the zoo reads the GGUF architectures {_supported()}."
    )
  return arch


def hf_config(meta: dict, names: list[str], path: str) -> dict:
  """The config.json dict of a GGUF file's metadata (`meta`: key -> value); `names`: its
  tensor names (an `output.weight` means untied embeddings)."""
  arch = _arch(meta, path)
  out = {"model_type": ARCHS[arch]}
  for key, field, _ in CONFIG_KEYS:
    if f"{arch}.{key}" in meta:
      out[field] = meta[f"{arch}.{key}"]
  if "vocab_size" not in out and "tokenizer.ggml.tokens" in meta:
    out["vocab_size"] = len(meta["tokenizer.ggml.tokens"])
  out.setdefault("num_key_value_heads", out.get("num_attention_heads"))
  default_head = out["hidden_size"] // out["num_attention_heads"]
  rotary = meta.get(f"{arch}.rope.dimension_count")
  out.setdefault("head_dim", rotary or default_head)
  if rotary and rotary != out["head_dim"]:
    raise UserError(f"{path}: RoPE on {rotary} of {out['head_dim']} head dims is not supported.")
  out["tie_word_embeddings"] = "output.weight" not in names
  out["hidden_act" if arch in ("llama", "qwen2", "qwen3") else "hidden_activation"] = (
    "silu" if arch in ("llama", "qwen2", "qwen3") else "gelu_pytorch_tanh"
  )
  scaling = meta.get(f"{arch}.rope.scaling.type", "none")
  if scaling == "linear":
    out["rope_scaling"] = {"rope_type": "linear", "factor": meta[f"{arch}.rope.scaling.factor"]}
  elif scaling == "yarn":
    original = meta[f"{arch}.rope.scaling.original_context_length"]
    out["rope_scaling"] = {
      "rope_type": "yarn",
      "factor": meta[f"{arch}.rope.scaling.factor"],
      "original_max_position_embeddings": original,
      "beta_fast": meta.get(f"{arch}.rope.scaling.yarn_beta_fast", 32.0),
      "beta_slow": meta.get(f"{arch}.rope.scaling.yarn_beta_slow", 1.0),
    }
  elif scaling != "none":
    raise UserError(f"{path}: RoPE scaling {scaling!r} is not supported (none, linear, yarn).")
  if arch in ("gemma2", "gemma3"):
    # llama.cpp scales queries by head_dim ** -0.5, by (D / N) ** -0.5 for the 27B models
    # (46 and 62 layers): llama-model.cpp's f_attention_scale.
    big = out["num_hidden_layers"] == (46 if arch == "gemma2" else 62)
    out["query_pre_attn_scalar"] = default_head if big else out["head_dim"]
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list):  # one flag a layer: sliding or not
      out["layer_types"] = [("sliding" if s else "full") + "_attention" for s in pattern]
    elif pattern:
      out["sliding_window_pattern"] = pattern
  if arch == "gemma3":
    out["rope_local_base_freq"] = meta.get(f"{arch}.rope.freq_base_swa", 10_000.0)
  return out


def _gguf_names(arch: str, model_type: str, num_layers: int, hf_names) -> dict[str, str]:
  """HF tensor name -> GGUF tensor name, by the gguf library's table for `arch`."""
  import gguf

  arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
  table = gguf.get_tensor_name_map(arch_id, num_layers)
  out = {}
  for name in hf_names:
    base, _, suffix = name.rpartition(".")
    mapped = table.get_name(base)
    if mapped is None:
      raise AssertionError(f"gguf has no {arch} name for {name} ({model_type})")
    out[name] = f"{mapped}.{suffix}"
  return out


def _permute(x: np.ndarray, heads: int, *, back: bool) -> np.ndarray:
  """llama.cpp's q/k row order (`LlamaModel.permute`: the two rotary halves of each head
  interleaved) from HF's, or `back` to it."""
  shape = x.shape
  half = shape[0] // heads // 2
  split = (heads, half, 2) if back else (heads, 2, half)
  return x.reshape(*split, *shape[1:]).swapaxes(1, 2).reshape(shape)


def _transform(
  arch: str, config: dict, gguf_name: str, x: np.ndarray, *, to_hf: bool
) -> np.ndarray:
  """The value transforms llama.cpp applies beyond renaming, undone (`to_hf`) or done."""
  if arch in PERMUTED_QK and gguf_name.split(".")[-2] in ("attn_q", "attn_k"):
    q = gguf_name.split(".")[-2] == "attn_q"
    heads = config["num_attention_heads" if q else "num_key_value_heads"]
    x = _permute(x, heads, back=to_hf)
  if arch in NORM_OFFSET and gguf_name.endswith("norm.weight"):
    x = x - NORM_OFFSET[arch] if to_hf else x + NORM_OFFSET[arch]
  return x


class GGUFTensors:
  """The tensors of a GGUF file under their HF names (`hf.SafeTensors`' interface), dequantized
  to float32 and in HF's layout when read; a tensor with no HF name keeps its GGUF name (and is
  reported as unexpected)."""

  def __init__(self, reader, arch: str, config: dict, hf_of: dict[str, str]):
    self.arch, self.config, self.reader = arch, config, reader
    self.tensors = {hf_of.get(t.name, t.name): t for t in reader.tensors if t.name not in DROPPED}

  def names(self) -> list[str]:
    return sorted(self.tensors)

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(int(n) for n in reversed(self.tensors[name].shape))

  def dtype(self, name: str) -> str:
    return "F32"  # dequantized when read

  def get(self, name: str) -> np.ndarray:
    import gguf

    t = self.tensors[name]
    shape = self.shape(name)
    # Dequantized a few rows at a time into the one fp32 array: the library's intermediates
    # (several times the tensor's size for K-quants) never exist for a whole tensor.
    x = np.empty(shape, np.float32)
    rows = x.reshape(-1, shape[-1])
    data = np.asarray(t.data).reshape(rows.shape[0], -1)
    chunk = max(1, DEQUANT_CHUNK // shape[-1])
    for i in range(0, rows.shape[0], chunk):
      part = gguf.quants.dequantize(data[i : i + chunk], t.tensor_type)
      rows[i : i + chunk] = part.reshape(-1, shape[-1])
    _release(self.reader)
    return _transform(self.arch, self.config, t.name, x, to_hf=True)


def _release(reader):
  """Drops the file's pages read so far from this process's memory (the reader maps the whole
  file; what was read would stay resident, the size of the file by the last tensor). They are
  the file's own, clean: a later read maps them back."""
  import mmap

  buffer = getattr(reader.data, "_mmap", None)
  if buffer is not None and hasattr(mmap, "MADV_DONTNEED"):
    buffer.madvise(mmap.MADV_DONTNEED)


def _check_types(reader, path: str):
  import gguf

  readable = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16}
  readable |= set(gguf.quants._type_traits)  # the types the library dequantizes
  bad = sorted({t.tensor_type.name for t in reader.tensors if t.tensor_type not in readable})
  if bad:
    raise UserError(f"{path} has tensors of types {bad}, which the gguf library cannot read.")


def read_config(path: str):
  """The model config of a GGUF file, read from its metadata and tensor names (no tensor data),
  and the config.json it stands for."""
  reader = _open(path)
  meta = _fields(reader)
  _arch(meta, path)
  names = [t.name for t in reader.tensors]
  config = hf_config(meta, names, path)
  mod = hf.params_module(hf.family_of(config["model_type"]))
  return mod.config_from_hf(config, names), config


def read_gguf(path: str, *, param_dtype: str = "float32", quantize=None):
  """The model config and params of a GGUF file, and what was read (`read_hf`'s contract): the
  config.json it stands for, the tensors dropped, and the file's metadata (`gguf`: key ->
  value, without the token lists). `quantize` (`qlora.quantizer`): applied to each tensor as it
  is dequantized (K-quants included), so a quantized base is never whole in fp32."""
  reader = _open(path)
  # The vocabulary's strings (the reader's parts of 152k tokens and merges: ~400 MiB of Python
  # objects for Qwen2.5) are the tokenizer's, read apart (`tokenizer_dir`): dropped before the
  # weights are read. Of the tokens, only their count is read here.
  tokens = reader.fields.get("tokenizer.ggml.tokens")
  count = None if tokens is None else len(tokens.data)
  for k in TOKEN_LISTS:
    reader.fields.pop(k, None)
  meta = _fields(reader)
  if count is not None:
    meta["tokenizer.ggml.tokens"] = range(count)
  arch = _arch(meta, path)
  _check_types(reader, path)
  names = [t.name for t in reader.tensors]
  config = hf_config(meta, names, path)
  mod = hf.params_module(hf.family_of(config["model_type"]))
  cfg = mod.config_from_hf(config, names)
  cfg.param_dtype = param_dtype
  rules, _ = hf._checked_rules(cfg, mod)
  wanted = [n for r in rules for n in hf.hf_names(r)]
  hf_of = {g: h for h, g in _gguf_names(arch, config["model_type"], cfg.num_layers, wanted).items()}
  tensors = GGUFTensors(reader, arch, config, hf_of)
  params, skipped = hf.from_hf(cfg, mod, tensors, src=path, quantize=quantize)
  skipped += [n for n in names if n in DROPPED]
  info = {
    "config": config,
    "skipped": skipped,
    "gguf": {k: v for k, v in meta.items() if k not in TOKEN_LISTS},
  }
  return cfg, params, info


def tokenizer_dir(path: str, out: str) -> list[str]:
  """Writes the tokenizer and chat template of the GGUF file `path` into the directory `out` as
  a Hugging Face tokenizer (tokenizer.json, tokenizer_config.json), by transformers' own GGUF
  tokenizer reader; returns the files written."""
  from transformers import AutoTokenizer

  reader = _open(path)
  meta = _fields(reader)
  _arch(meta, path)
  if "tokenizer.ggml.model" not in meta:
    raise UserError(f"{path} holds no tokenizer (tokenizer.ggml.model).")
  path = os.path.abspath(path)
  if importlib.util.find_spec("torch") is None:  # transformers' GGUF reader imports it
    raise UserError(
      f"Reading the tokenizer of {path} uses transformers' GGUF reader, which needs PyTorch: "
      "pip install torch (the CPU build is enough)."
    )
  try:
    tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
  except Exception as e:
    raise UserError(
      f"transformers cannot read the tokenizer of {path} ({type(e).__name__}: {str(e)[:160]})."
    ) from None
  template = meta.get("tokenizer.chat_template")
  if template and not tok.chat_template:
    tok.chat_template = template
  os.makedirs(out, exist_ok=True)
  before = set(os.listdir(out))
  tok.save_pretrained(out)
  config_path = os.path.join(out, "tokenizer_config.json")
  with open(config_path, encoding="utf-8") as f:
    config = json.load(f)
  if template and "chat_template" not in config:  # one file holds it all (zoo chat reads both)
    config["chat_template"] = template
    with open(config_path, "w", encoding="utf-8") as f:
      json.dump(config, f, indent=2, ensure_ascii=False)
  return sorted(set(os.listdir(out)) - before)


# Writing


def _tokenizer_json(workdir: str, meta: dict) -> tuple[str | None, dict]:
  """The tokenizer.json of a zoo checkpoint (in its workdir, or where its data.tokenizer points)
  and its tokenizer_config.json (or {})."""
  tok = meta.get("data", {}).get("tokenizer", {})
  places = [workdir]
  if tok.get("kind") == "hf" and tok.get("path"):
    path = tok["path"]
    places.append(path if os.path.isdir(path) else os.path.dirname(path))
  for place in places:
    if os.path.isfile(os.path.join(place, "tokenizer.json")):
      config = {}
      if os.path.isfile(os.path.join(place, "tokenizer_config.json")):
        with open(os.path.join(place, "tokenizer_config.json"), encoding="utf-8") as f:
          config = json.load(f)
      if "chat_template" not in config and os.path.isfile(
        os.path.join(place, "chat_template.jinja")
      ):
        with open(os.path.join(place, "chat_template.jinja"), encoding="utf-8") as f:
          config["chat_template"] = f.read()
      return os.path.join(place, "tokenizer.json"), config
  return None, {}


def _token_name(value) -> str | None:
  return value.get("content") if isinstance(value, dict) else value


def _add_tokenizer(writer, path: str, config: dict, vocab_size: int, pre: str) -> str:
  """Writes a byte-level BPE tokenizer.json (GPT-2's kind: SmolLM, Qwen, Llama 3) as llama.cpp's
  "gpt2" tokenizer, padded to the model's vocabulary as llama.cpp's converter pads it; returns
  what was written ("gpt2", or "none: why" for a tokenizer of another kind)."""
  import gguf

  with open(path, encoding="utf-8") as f:
    tok = json.load(f)
  model = tok.get("model", {})
  if model.get("type") != "BPE" or "ByteLevel" not in json.dumps(tok.get("pre_tokenizer")):
    return "none: only byte-level BPE tokenizers (GPT-2's kind) are written"
  tokens: dict[int, str] = {i: t for t, i in model["vocab"].items()}
  types = {i: gguf.TokenType.NORMAL for i in tokens}
  for added in tok.get("added_tokens", []):
    tokens[added["id"]] = added["content"]
    special = added.get("special")
    types[added["id"]] = gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED
  if max(tokens) >= vocab_size:
    return f"none: the tokenizer has ids up to {max(tokens)}, the model {vocab_size}"
  ids = range(vocab_size)
  writer.add_tokenizer_model("gpt2")
  writer.add_tokenizer_pre(pre or "default")
  writer.add_token_list([tokens.get(i, f"[PAD{i}]") for i in ids])
  writer.add_token_types([int(types.get(i, gguf.TokenType.UNUSED)) for i in ids])
  merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
  writer.add_token_merges(merges)
  by_text = {t: i for i, t in tokens.items()}
  for key, add in (
    ("bos_token", writer.add_bos_token_id),
    ("eos_token", writer.add_eos_token_id),
    ("unk_token", writer.add_unk_token_id),
    ("pad_token", writer.add_pad_token_id),
  ):
    if _token_name(config.get(key)) in by_text:
      add(by_text[_token_name(config[key])])
  writer.add_add_bos_token(bool(config.get("add_bos_token", False)))
  if isinstance(config.get("chat_template"), str):
    writer.add_chat_template(config["chat_template"])
  return "gpt2"


def _quantized(x: np.ndarray, kind: str):
  """`x` as the GGUF type of `kind` (llama.cpp keeps 1-D tensors in F32, and a matrix whose
  rows do not fill Q8_0's 32-value blocks in F16): (array, raw dtype or None)."""
  import gguf

  x = np.ascontiguousarray(x, np.float32)
  Q = gguf.GGMLQuantizationType
  if kind == "f32" or x.ndim < 2:
    return x, None
  if kind == "f16" or (kind == "q8_0" and x.shape[-1] % 32):
    return x.astype(np.float16), None
  qtype = Q.BF16 if kind == "bf16" else Q.Q8_0
  return gguf.quants.quantize(x, qtype), qtype


def write(cfg, params, meta: dict, workdir: str, out: str, *, type: str = "f32") -> dict:  # noqa: A002
  """Writes a model (its config `cfg`, params and checkpoint `meta`, read from `workdir`) as the
  GGUF file `out`: llama.cpp's metadata and tensor names, the tokenizer and chat template found
  in `workdir`; `type`: f32, f16, bf16 or q8_0 (1-D tensors stay F32). Written to a temporary
  file, then renamed. What `weights.export_gguf` calls."""
  import gguf

  if type not in EXPORT_TYPES:
    raise UserError(f"--type {type!r}: use one of {', '.join(EXPORT_TYPES)}.")
  families = ("llama", "gemma")
  if cfg.family not in families:
    raise UserError(
      f"GGUF export holds decoders of the architectures {_supported()}: the {cfg.family} "
      "family is none of them."
    )
  mod = hf.params_module(cfg.family)
  source = meta.get("source", {})
  config = mod.config_to_hf(cfg, source.get("config", {}).get("model_type"))
  if config["model_type"] not in MODEL_TYPES:
    raise UserError(
      f"GGUF export holds the architectures {_supported()}: this model is a {config['model_type']}."
    )
  arch = MODEL_TYPES[config["model_type"]]
  if arch == "llama" and cfg.attention.window:  # llama.cpp's llama has no sliding window
    raise UserError("GGUF export of a Llama-family model with a sliding window is not supported.")
  scaling = cfg.position.scaling.to_dict()
  if scaling["kind"] not in ("none", "linear", "yarn"):
    raise UserError(
      f"GGUF export of RoPE scaling {scaling['kind']!r} is not supported (none, linear, yarn)."
    )
  tensors = hf.to_hf(cfg, mod, params)
  names = _gguf_names(arch, config["model_type"], cfg.num_layers, tensors)
  tok_path, tok_config = _tokenizer_json(workdir, meta)
  kept = source.get("config", {})
  context = kept.get("max_position_embeddings") or CONTEXT_LENGTH
  config = {"max_position_embeddings": context, **config}
  if arch == "gemma2":  # transformers' Gemma 2 config has no layer_types; llama.cpp: 1 in 2
    config.pop("layer_types", None)

  out = os.path.abspath(out)
  os.makedirs(os.path.dirname(out), exist_ok=True)
  tmp = os.path.join(os.path.dirname(out), f".{os.path.basename(out)}.tmp-{os.getpid()}")
  tokenizer = "none: the checkpoint has no tokenizer.json"
  try:
    writer = gguf.GGUFWriter(tmp, arch)
    writer.add_name(os.path.basename(os.path.normpath(workdir)))
    ftype = {"f32": 0, "f16": 1, "q8_0": 7, "bf16": 32}[type]
    writer.add_file_type(ftype)
    if type in ("q8_0",):
      writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for key, field, kind in CONFIG_KEYS:
      value = config.get(field)
      if value is not None:
        add = writer.add_uint32 if kind == "uint32" else writer.add_float32
        add(f"{arch}.{key}", int(value) if kind == "uint32" else float(value))
    writer.add_uint32(f"{arch}.attention.value_length", int(config["head_dim"]))
    writer.add_uint32(f"{arch}.rope.dimension_count", int(config["head_dim"]))
    if scaling["kind"] != "none":
      writer.add_string(f"{arch}.rope.scaling.type", scaling["kind"])
      writer.add_float32(f"{arch}.rope.scaling.factor", float(scaling["factor"]))
    if scaling["kind"] == "yarn":
      original = int(scaling["original_max_len"])
      writer.add_uint32(f"{arch}.rope.scaling.original_context_length", original)
      writer.add_float32(f"{arch}.rope.scaling.yarn_beta_fast", float(scaling["beta_fast"]))
      writer.add_float32(f"{arch}.rope.scaling.yarn_beta_slow", float(scaling["beta_slow"]))
    if arch == "gemma3":
      rope = config.get("rope_parameters", {})
      local = rope.get("sliding_attention", {}).get("rope_theta", config["rope_local_base_freq"])
      writer.add_float32(f"{arch}.rope.freq_base_swa", float(local))
      sliding = [t == "sliding_attention" for t in config["layer_types"]]
      writer.add_sliding_window_pattern(sliding)
    if tok_path:
      pre = source.get("tokenizer_pre", "")
      tokenizer = _add_tokenizer(writer, tok_path, tok_config, cfg.vocab_size, pre)
    for hf_name, x in tensors.items():
      name = names[hf_name]
      value = _transform(arch, config, name, np.asarray(x, np.float32), to_hf=False)
      data, raw = _quantized(value, type)
      writer.add_tensor(name, data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.rename(tmp, out)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)
  return {
    "out": out,
    "architecture": arch,
    "type": type,
    "tensors": len(tensors),
    "params": int(sum(np.prod(t.shape) for t in tensors.values())),
    "tokenizer": tokenizer,
  }
