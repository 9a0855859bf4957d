"""common/config.py (overrides, flattening, golden text) and common/experiments.split_arg."""

import ml_collections
import pytest

from nnx_zoo.common import config as config_lib
from nnx_zoo.common import experiments
from nnx_zoo.common.errors import UserError


def make_cfg() -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(
    {
      "seed": 0,
      "init_from": "",
      "note": None,
      "train": {"steps": 100, "lr": 3e-4, "shuffle": True, "sizes": [1, 2], "pair": (3, 4)},
      "model": {"dim": 64, "position": {"kind": "rope", "theta": 1e4}},
    }
  )


# apply_overrides: each value is parsed to the type the key has now


@pytest.mark.parametrize(
  "key, text, expected",
  [
    ("seed", "7", 7),
    ("seed", "-3", -3),
    ("train.steps", "1_000", 1000),
    ("train.lr", "1e-3", 1e-3),
    ("train.lr", "2", 2.0),
    ("train.shuffle", "false", False),
    ("train.shuffle", "False", False),
    ("train.shuffle", "0", False),
    ("train.shuffle", "yes", True),
    ("init_from", "runs/a", "runs/a"),
    ("init_from", "123", "123"),
    ("train.sizes", "[4, 5, 6]", [4, 5, 6]),
    ("train.sizes", "[]", []),
    ("train.pair", "[7, 8]", (7, 8)),
    ("note", "[1, 2]", [1, 2]),
    ("note", "hello", "hello"),
    ("model.position.theta", "500000", 5e5),
    ("model.position.kind", "alibi", "alibi"),
  ],
)
def test_override_parses_by_existing_type(key, text, expected):
  cfg = config_lib.apply_overrides(make_cfg(), {key: text})
  value = config_lib.flatten(cfg)[key]
  assert value == expected
  assert type(value) is type(expected)


def test_overrides_apply_together_and_leave_the_rest():
  cfg = config_lib.apply_overrides(make_cfg(), {"seed": "1", "model.dim": "128"})
  flat = config_lib.flatten(cfg)
  assert (flat["seed"], flat["model.dim"]) == (1, 128)
  assert {k: v for k, v in flat.items() if k not in ("seed", "model.dim")} == {
    k: v for k, v in config_lib.flatten(make_cfg()).items() if k not in ("seed", "model.dim")
  }


def test_no_overrides_is_identity():
  assert config_lib.flatten(config_lib.apply_overrides(make_cfg(), {})) == config_lib.flatten(
    make_cfg()
  )


@pytest.mark.parametrize(
  "key, close",
  [("train.step", "train.steps"), ("model.dimm", "model.dim"), ("sed", "seed")],
)
def test_unknown_key_suggests_close_name(key, close):
  with pytest.raises(UserError) as e:
    config_lib.apply_overrides(make_cfg(), {key: "1"})
  msg = str(e.value)
  assert repr(key) in msg and "Did you mean" in msg and close in msg


def test_unknown_key_without_close_name():
  with pytest.raises(UserError, match="Unknown config key 'zzzzzz'") as e:
    config_lib.apply_overrides(make_cfg(), {"zzzzzz": "1"})
  assert "Did you mean" not in str(e.value)


@pytest.mark.parametrize(
  "key, text, type_name",
  [
    ("train.steps", "abc", "int"),
    ("train.steps", "1.5", "int"),
    ("train.lr", "fast", "float"),
    ("train.shuffle", "maybe", "bool"),
    ("train.sizes", "3", "a list"),
    ("train.sizes", "[1", "a list"),
  ],
)
def test_wrong_type_names_key_and_type(key, text, type_name):
  with pytest.raises(UserError) as e:
    config_lib.apply_overrides(make_cfg(), {key: text})
  msg = str(e.value)
  assert f"--config.{key}={text}" in msg and f"takes {type_name}" in msg


@pytest.mark.parametrize("key", ["train", "model", "model.position"])
def test_group_key_is_refused(key):
  with pytest.raises(UserError, match="names a group of keys") as e:
    config_lib.apply_overrides(make_cfg(), {key: "1"})
  assert f"--config.{key}." in str(e.value)  # it lists some of the keys it holds


def test_failed_override_leaves_the_config_usable():
  cfg = make_cfg()
  with pytest.raises(UserError):
    config_lib.apply_overrides(cfg, {"train.steps": "x"})
  assert cfg.train.steps == 100


# flatten, golden_text, JSON


def test_flatten():
  flat = config_lib.flatten(make_cfg())
  assert flat == {
    "seed": 0,
    "init_from": "",
    "note": None,
    "train.steps": 100,
    "train.lr": 3e-4,
    "train.shuffle": True,
    "train.sizes": [1, 2],
    "train.pair": (3, 4),
    "model.dim": 64,
    "model.position.kind": "rope",
    "model.position.theta": 1e4,
  }
  assert config_lib.flatten({"a": {"b": 1}, "c": 2}) == {"a.b": 1, "c": 2}
  assert config_lib.flatten(ml_collections.ConfigDict()) == {}


def test_golden_text():
  text = config_lib.golden_text(make_cfg())
  assert text == (
    "init_from: ''\n"
    "model.dim: 64\n"
    "model.position.kind: 'rope'\n"
    "model.position.theta: 10000.0\n"
    "note: None\n"
    "seed: 0\n"
    "train.lr: 0.0003\n"
    "train.pair: (3, 4)\n"
    "train.shuffle: True\n"
    "train.sizes: [1, 2]\n"
    "train.steps: 100\n"
  )
  # Sorted, so the order keys were set in does not show in a diff.
  reordered = ml_collections.ConfigDict({"b": 1, "a": {"y": 2, "x": 3}})
  assert config_lib.golden_text(reordered) == "a.x: 3\na.y: 2\nb: 1\n"


def test_json_round_trip():
  cfg = make_cfg()
  back = config_lib.from_json(config_lib.to_json(cfg))
  flat = config_lib.flatten(back)
  assert flat["train.pair"] == [3, 4]  # JSON has no tuples
  flat["train.pair"] = (3, 4)
  assert flat == config_lib.flatten(cfg)


# split_arg: EXP[:ARG]


@pytest.mark.parametrize(
  "exp, expected",
  [
    ("lm/llama3-8b:smoke", ("lm/llama3-8b", "smoke")),
    ("lm/llama3-8b", ("lm/llama3-8b", None)),
    ("lm/qwen3-0.6b:smoke", ("lm/qwen3-0.6b", "smoke")),
    ("./mine.py:smoke", ("./mine.py", "smoke")),
    ("./mine.py", ("./mine.py", None)),
    ("/abs/dir/mine.py:smoke", ("/abs/dir/mine.py", "smoke")),
    ("C:\\runs\\mine.py", ("C:\\runs\\mine.py", None)),  # a drive letter, not an argument
    ("C:/runs/mine.py", ("C:/runs/mine.py", None)),
    ("C:/runs/mine.py:smoke", ("C:/runs/mine.py", "smoke")),
  ],
)
def test_split_arg(exp, expected):
  assert experiments.split_arg(exp) == expected


def test_differences_names_changed_keys_and_ignores_tuple_vs_list():
  old = ml_collections.ConfigDict({"model": {"dim": 64, "shape": (1, 2)}, "train": {"steps": 1}})
  new = ml_collections.ConfigDict({"model": {"dim": 32, "shape": [1, 2]}, "train": {"steps": 2}})
  assert config_lib.differences(old, new, within=("model.",)) == ["model.dim: 64 -> 32"]
  assert config_lib.differences(old, new) == ["model.dim: 64 -> 32", "train.steps: 1 -> 2"]


def test_differences_take_keys_added_later_as_their_neutral_value():
  """A workdir saved before model.lora / data.train_plays existed still matches its experiment;
  a real change of one of them does not."""
  new = experiments.get_config("lm/shakespeare-char:smoke")
  old = ml_collections.ConfigDict(new.to_dict())
  for key in ("lora", "scan"):
    del old.model[key]
  del old.data["train_plays"], old.data["eval_fraction"]
  assert config_lib.differences(old, new, within=("model.", "data.")) == []
  new.model.lora.rank = 4
  assert config_lib.differences(old, new) == ["model.lora.rank: 0 -> 4"]
  images = experiments.get_config("vision/vit-digits:smoke")
  before_mix = ml_collections.ConfigDict(images.to_dict())
  del before_mix.data["mix"], before_mix.data["mix_alpha"], before_mix.data["mix_prob"]
  assert config_lib.differences(before_mix, images, within=("data.",)) == []
  images.data.mix = "cutmix"
  assert config_lib.differences(before_mix, images) == ["data.mix: 'none' -> 'cutmix'"]


FAMILY_KEYS = {  # a key each family's tiny preset reads, misspelt as users do
  "llama": "num_kv_heads",
  "gemma": "num_kv_heads",
  "gpt2": "num_layers",
  "bert": "num_layers",
  "t5": "num_layers",
  "vit": "num_layers",
  "whisper": "num_layers",
  "dit": "num_layers",
  "clip": "projection_dim",
}


@pytest.mark.parametrize("family", sorted(FAMILY_KEYS))
def test_a_family_preset_refuses_an_override_it_does_not_read(family):
  """Every family's config goes through the one preset lookup: a misspelt override is an error
  naming the key it meant, not a default taken in silence."""
  from nnx_zoo.common import models

  module = models.family_module(family)
  key, config = FAMILY_KEYS[family], module.config
  same = {key: module.PRESETS["tiny"][key]}  # the key is read: its own value changes nothing
  assert config("tiny", **same).to_dict() == config("tiny").to_dict()
  with pytest.raises(UserError, match=rf"reads no key '{key[:-1]}'.*Did you mean: {key}"):
    config("tiny", **{key[:-1]: 1})
  with pytest.raises(UserError, match=f"Unknown {family} preset 'tinyy'"):
    config("tinyy")
