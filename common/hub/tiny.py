"""Tiny random checkpoints named `tiny:NAME`, made on first use: what the smoke forms of the
experiments that take their model from `init_from` start from, so no test downloads a model.

`tiny:llama` is a Hugging Face directory as `save_pretrained` writes one: a 2-layer Llama with
random weights (config.json, model.safetensors), a byte-level BPE tokenizer trained on a few
lines (tokenizer.json) with ChatML's special tokens and chat template (tokenizer_config.json),
as SmolLM2-135M-Instruct has. It is built once per machine into the zoo's cache directory and
is the same, bit for bit, wherever it is built (fixed seed, fixed training text).
"""

import json
import os
import shutil

import jax
import ml_collections
import numpy as np
from flax import nnx

from nnx_zoo.common import files, models
from nnx_zoo.common.errors import UserError, suggest
from nnx_zoo.common.hub import hf

PREFIX = "tiny:"
VERSION = 1  # part of the cache path: a change to what is written here makes a new directory

# ChatML, as SmolLM2-Instruct and Qwen write it (without the default system message).
CHATML = (
  "{% for message in messages %}"
  "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
  "{% endfor %}"
  "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2, as SmolLM2's
TEXT = (
  "To be, or not to be, that is the question: Whether 'tis nobler in the mind to suffer\n"
  "The slings and arrows of outrageous fortune, Or to take arms against a sea of troubles\n"
  "And by opposing end them. What is the answer? The answer is: 12 + 30 = 42.\n"
)
NAMES = {
  # A Llama of the zoo's "tiny" preset over the tokenizer's 320 ids.
  "llama": dict(family="llama", preset="tiny", vocab_size=320),
  # The same tokenizer and a 4-layer Llama: a teacher for `tiny:llama` (chat/distill's smoke form).
  "llama4": dict(family="llama", preset="tiny", vocab_size=320, num_layers=4),
}


def is_tiny(path: str) -> bool:
  return path.startswith(PREFIX)


def checkpoint(path: str) -> str:
  """The directory of `tiny:NAME`, written on first use (atomically: a concurrent builder's
  directory is as good as this one's)."""
  name = path[len(PREFIX) :]
  if name not in NAMES:
    raise UserError(
      f"Unknown tiny checkpoint {path!r}.{suggest(name, NAMES)} Known: {list(NAMES)}."
    )
  out = files.cache_dir("tiny", f"{name}-v{VERSION}")
  if not os.path.isfile(os.path.join(out, "config.json")):
    tmp = f"{out}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
      _write(NAMES[name], tmp)
      os.rename(tmp, out)
    except OSError:
      if not os.path.isfile(os.path.join(out, "config.json")):  # not another process's
        raise
    finally:
      shutil.rmtree(tmp, ignore_errors=True)
  return out


def tokenizer(vocab_size: int):
  """A byte-level BPE (every byte a token, so nothing is unknown) trained on TEXT up to
  `vocab_size` ids, the special tokens first."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=vocab_size,
    special_tokens=list(SPECIAL),
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False,
  )
  tok.train_from_iterator([TEXT], trainer=trainer)
  return tok


def _write(spec: dict, out: str):
  from safetensors.numpy import save_file

  os.makedirs(out)
  tok = tokenizer(spec["vocab_size"])
  tok.save(os.path.join(out, "tokenizer.json"))
  with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
    json.dump(
      {
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
        "chat_template": CHATML,
        "tokenizer_class": "PreTrainedTokenizerFast",
      },
      f,
      indent=2,
    )
  family = models.family_module(spec["family"])
  overrides = {k: v for k, v in spec.items() if k not in ("family", "preset")}
  cfg = family.config(spec["preset"], **overrides)
  cfg = ml_collections.ConfigDict(cfg.to_dict())
  params = nnx.state(models.build(cfg, seed=0), nnx.Param)
  mod = hf.params_module(spec["family"])
  tensors = {k: np.asarray(jax.device_get(v)) for k, v in hf.to_hf(cfg, mod, params).items()}
  save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
  hf_config = mod.config_to_hf(cfg)
  hf_config.update(bos_token_id=1, eos_token_id=2, pad_token_id=2)
  with open(os.path.join(out, "config.json"), "w") as f:
    json.dump(hf_config, f, indent=2, sort_keys=True)
