"""Config helpers: `--config.KEY=VALUE` overrides with type checks, flattening, comparison."""

import ast
import functools
import json

import ml_collections

from nnx_zoo.common.errors import UserError, suggest


def preset_values(presets: dict, name: str, overrides: dict, *, family: str) -> dict:
  """A family's preset (its published dimensions) with overrides; an unknown name is a
  UserError naming the close ones."""
  if name not in presets:
    raise UserError(f"Unknown {family} preset {name!r}.{suggest(name, presets)}")
  base = presets[name]
  # A nested entry (CLIP's towers) takes the keys it is given and keeps the others.
  return {
    **base,
    **{
      k: {**base[k], **v} if isinstance(v, dict) and isinstance(base.get(k), dict) else v
      for k, v in overrides.items()
    },
  }


class Preset(dict):
  """A preset's values with their overrides, remembering which keys the family reads."""

  def __init__(self, values: dict):
    super().__init__(values)
    self.read: set[str] = set()

  def __getitem__(self, key):
    self.read.add(key)
    return super().__getitem__(key)

  def get(self, key, default=None):
    self.read.add(key)
    return super().get(key, default)

  def __contains__(self, key):
    self.read.add(key)
    return super().__contains__(key)


def family_config(presets: dict, *, family: str):
  """The one preset lookup of every family: decorates `build(p) -> ConfigDict` into the family's
  `config(preset="tiny", **overrides)`. An unknown preset, and an override that the build never
  reads (a misspelt key, or one that only applies with other settings), are UserErrors naming
  the nearest names."""

  def wrap(build):
    @functools.wraps(build)
    def config(preset: str = "tiny", **overrides) -> ml_collections.ConfigDict:
      p = Preset(preset_values(presets, preset, overrides, family=family))
      cfg = build(p)
      unread = sorted(set(overrides) - p.read)
      if unread:
        known = sorted(p.read | set(presets[preset]))
        raise UserError(
          f"{family}.config({preset!r}) reads no key {unread[0]!r} (a misspelt key, or one that "
          f"applies only with other settings).{suggest(unread[0], known)} It reads: "
          f"{', '.join(known)}."
        )
      return cfg

    return config

  return wrap


def flatten(cfg, prefix: str = "") -> dict:
  """{"train.steps": 100, ...} for every leaf of a config tree, in key order."""
  out = {}
  for key, value in cfg.items():
    name = f"{prefix}{key}"
    if isinstance(value, ml_collections.ConfigDict | dict):
      out.update(flatten(value, name + "."))
    else:
      out[name] = value
  return out


def _parse(text: str, current, key: str):
  """The override's text as a value of the type the key has now."""
  if isinstance(current, bool):
    low = text.lower()
    if low in ("true", "1", "yes"):
      return True
    if low in ("false", "0", "no"):
      return False
  elif isinstance(current, int):
    try:
      return int(text)
    except ValueError:
      pass
  elif isinstance(current, float):
    try:
      return float(text)
    except ValueError:
      pass
  elif isinstance(current, str):
    return text
  elif current is None:
    try:
      return ast.literal_eval(text)
    except (ValueError, SyntaxError):
      return text
  elif isinstance(current, list | tuple):
    try:
      value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
      value = None
    if isinstance(value, list | tuple):
      return type(current)(value)
  type_name = "a list" if isinstance(current, list | tuple) else type(current).__name__
  raise UserError(
    f"--config.{key}={text}: {key} takes {type_name} (it is {current!r} now), "
    f"and {text!r} is not one. Give a value of that type, e.g. --config.{key}={current!r}."
  )


def apply_overrides(cfg: ml_collections.ConfigDict, overrides: dict[str, str]):
  """Sets each dotted KEY to VALUE (a string, parsed to the key's type); unknown keys fail."""
  keys = flatten(cfg)
  for key, text in overrides.items():
    if key not in keys:
      subtree = [k for k in keys if k.startswith(key + ".")]
      if subtree:
        raise UserError(
          f"--config.{key} names a group of keys, not one value: set them one by one "
          f"({', '.join('--config.' + k for k in subtree[:4])}...)."
        )
      raise UserError(
        f"Unknown config key {key!r}.{suggest(key, keys)} "
        "`zoo show EXP` lists every key the experiment has."
      )
    *parents, leaf = key.split(".")
    node = cfg
    for p in parents:
      node = node[p]
    node[leaf] = _parse(text, keys[key], key)
  return cfg


# Keys added after configs were first saved, with the value that means what their absence
# meant: a workdir or checkpoint written before them still matches the same model and data.
ADDED_LATER = {
  "model.lora.rank": 0,
  "model.lora.alpha": 16.0,
  "model.lora.targets": "attn.q,attn.v",
  "model.lora.train": "",
  "model.lora.base_quant": "",
  "model.lora.frozen_dtype": "",
  "model.num_labels": 0,
  "model.scan": False,
  "model.pipeline_repeats": 1,
  "model.drop_path": 0.0,
  "model.quant": "none",
  "model.quant_backward": True,
  "data.train_plays": "",
  "data.eval_fraction": 0.0,
  "data.mix": "none",
  "data.mix_alpha": 1.0,
  "data.mix_prob": 1.0,
  "data.freq_warp": [1.0, 1.0],
  "data.tempo_perturb": [1.0, 1.0],
  "data.noise_prob": 1.0,
  "data.path": "",
  "data.mixture": "",
  "data.workers": 0,
  "data.format": "text",
  "data.messages_field": "messages",
  "data.chat_template": "",
  "data.loss_on": "assistant",
  "data.rejected": "",
  "data.rejected_max_tokens": 64,
  "data.max_records": 0,
  "data.pairs_per_row": "one",
  "data.problems": "sums",
}


def differences(
  old, new, *, within: tuple[str, ...] = ("",), ignore: tuple[str, ...] = (), limit: int = 6
) -> list[str]:
  """'key: old -> new' for each leaf (under the prefixes `within`, not one of the keys `ignore`)
  that differs, both sides compared as JSON would store them (so a tuple equals the list it is
  saved as); a key of ADDED_LATER missing on one side counts as its neutral value."""
  a, b = (flatten(from_json(to_json(c))) for c in (old, new))
  for side in (a, b):
    if "model.family" in side or "data.kind" in side:  # a model or data config at all
      side.update({k: v for k, v in ADDED_LATER.items() if k not in side})
  keys = sorted(
    k
    for k in set(a) | set(b)
    if k.startswith(within) and k not in ignore and a.get(k, "<absent>") != b.get(k, "<absent>")
  )
  return [f"{k}: {a.get(k, '<absent>')!r} -> {b.get(k, '<absent>')!r}" for k in keys[:limit]]


def to_json(cfg) -> str:
  tree = cfg.to_dict() if isinstance(cfg, ml_collections.ConfigDict) else cfg
  return json.dumps(tree, indent=2, sort_keys=True, default=str)


def from_json(text: str) -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(json.loads(text))


def golden_text(cfg) -> str:
  """One `key: value` line per leaf, sorted: what tests/golden/<name>.txt holds."""
  return "".join(f"{k}: {v!r}\n" for k, v in sorted(flatten(cfg).items()))
