"""How a converted checkpoint generates: what transformers' `generate` reads from the
generation_config.json that `zoo convert hf` copies (the decoder's forced prompt, the end token,
the suppressed tokens), as arguments of `engine.generate_seq2seq`.

What is general lives here: `forced_decoder_ids`, `eos_token_id`, `suppress_tokens`,
`begin_suppress_tokens`. A family whose prompt depends on choices (Whisper's language and task)
says how in its params.py: `decoder_prompt(generation, *, language, task) -> [ids]`, start token
included; a family without it takes neither choice.
"""

import dataclasses
import json
import os

from nnx_zoo.common import keymap
from nnx_zoo.common.errors import UserError
from nnx_zoo.common.hub.hf import params_module

FILE = "generation_config.json"


@dataclasses.dataclass(frozen=True)
class Settings:
  decoder_prompt: tuple[int, ...]  # the decoder's first tokens, its start token included
  eos_ids: tuple[int, ...]  # a row ends at the first of these
  suppress_ids: tuple[int, ...] = ()  # never written
  begin_suppress_ids: tuple[int, ...] = ()  # not written as the first token after the prompt


def read(workdir: str) -> dict | None:
  """generation_config.json of a `zoo convert` output (or an HF directory); None without one."""
  path = os.path.join(workdir, FILE)
  if not os.path.isfile(path):
    return None
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError) as e:
    raise UserError(f"{path} is not a JSON file ({e}).") from None


def end_ids(cfg, workdir: str) -> tuple[int, ...] | None:
  """The end tokens a converted model names: generation_config.json's `eos_token_id`, as
  transformers' generate reads it, else its HF config's; None where neither names any (a zoo
  run)."""
  config = read(workdir)
  if config is None and "source" in cfg and "config" in cfg.source:
    config = cfg.source.config.to_dict()
  value = (config or {}).get("eos_token_id")
  return None if value is None else _ids(value)


def _ids(value) -> tuple[int, ...]:
  if value is None:
    return ()
  return tuple(int(i) for i in (value if isinstance(value, list | tuple) else [value]))


def settings(
  family: str,
  generation: dict,
  *,
  config: dict | None = None,
  language: str | None = None,
  task: str | None = None,
) -> Settings:
  """The settings of a model of `family` whose generation_config.json is `generation`; the
  token ids it lacks are read from the model's config.json (`config`), as transformers does."""
  inherited = ("decoder_start_token_id", "eos_token_id", "forced_decoder_ids")
  generation = {
    **{k: v for k, v in (config or {}).items() if k in inherited and v is not None},
    **{k: v for k, v in generation.items() if v is not None},
  }
  if "decoder_start_token_id" not in generation:
    raise UserError(f"Neither {FILE} nor config.json names the decoder_start_token_id.")
  prompt_of = getattr(params_module(family), "decoder_prompt", None)
  if prompt_of is not None:
    prompt = prompt_of(generation, language=language, task=task)
  else:
    if language is not None or task is not None:
      raise UserError(f"A {family} model takes no --language or --task.")
    forced = keymap.forced_tokens(generation)
    prompt = [generation["decoder_start_token_id"]]
    prompt += forced[: forced.index(None)] if None in forced else forced
  eos = _ids(generation.get("eos_token_id"))
  if not eos:
    raise UserError(f"{FILE} names no eos_token_id: generation would not know where to stop.")
  return Settings(
    decoder_prompt=tuple(int(i) for i in prompt),
    eos_ids=eos,
    suppress_ids=_ids(generation.get("suppress_tokens")),
    begin_suppress_ids=_ids(generation.get("begin_suppress_tokens")),
  )


def until_eos(tokens, eos_ids) -> list[int]:
  """`tokens` up to (without) the first end token."""
  tokens = [int(t) for t in tokens]
  ends = [i for i, t in enumerate(tokens) if t in eos_ids]
  return tokens[: ends[0]] if ends else tokens
