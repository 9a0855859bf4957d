"""On-policy preference pairs (data.rejected="init_from"): the init_from model's greedy replies,
sampled in batches, equal one-prompt-at-a-time greedy decoding, and are sampled only once."""

import jax
import ml_collections
import numpy as np
import pytest

from nnx_zoo.common import engine
from nnx_zoo.common.data import chat, rollouts, tokenizers
from nnx_zoo.common.hub import tiny, weights

KEY = jax.random.key(0)
PROMPTS = [
  [{"role": "user", "content": "To be, or not to be?"}],
  [{"role": "system", "content": "You are HAMLET."}, {"role": "user", "content": "My lord?"}],
  [{"role": "user", "content": "What is the answer? The answer is"}],
]


@pytest.fixture
def setting(monkeypatch, tmp_path):
  monkeypatch.setenv("NNX_ZOO_CACHE", str(tmp_path / "cache"))
  path = tiny.checkpoint("tiny:llama")
  src = weights.source(path)
  cfg = ml_collections.ConfigDict(
    {"init_from": path, "data": {"rejected_max_tokens": 6, "tokenizer": src.tokenizer.to_dict(),
                                 "chat_template": ""}}
  )  # fmt: skip
  return cfg, chat.template(cfg.data), tokenizers.load(cfg.data.tokenizer)


def test_batched_replies_are_greedy_decoding(setting):
  cfg, template, tokenizer = setting
  got = rollouts.replies(cfg, PROMPTS, template=template, tokenizer=tokenizer)
  model = weights.load(cfg.init_from)
  for prompt, reply in zip(PROMPTS, got, strict=True):
    ids, _ = tokenizer.encode_chat(template.render(prompt, add_generation_prompt=True))
    out = np.asarray(engine.generate(model, ids[None], max_new_tokens=6, rng=KEY, temperature=0))
    new = out[0, len(ids) :].tolist()
    if tokenizer.eos_id in new:
      new = new[: new.index(tokenizer.eos_id)]
    assert reply == tokenizer.decode(new).split(template.end_of_turn)[0].strip()


def test_replies_are_sampled_once(setting, monkeypatch):
  cfg, template, tokenizer = setting
  first = rollouts.replies(cfg, PROMPTS, template=template, tokenizer=tokenizer)

  def no_sampling(*args, **kwargs):
    raise AssertionError("sampled again: the cache was not read")

  monkeypatch.setattr(rollouts, "_sample", no_sampling)
  assert rollouts.replies(cfg, PROMPTS, template=template, tokenizer=tokenizer) == first
  cfg.data.rejected_max_tokens = 5  # another setting: another key
  with pytest.raises(AssertionError, match="sampled again"):
    rollouts.replies(cfg, PROMPTS, template=template, tokenizer=tokenizer)
