"""`nn.keys.Keys`, the keys every model (and LoRA's adapters) is built from: the keys, and so the
weights, `nnx.Rngs` gives, bit for bit, in the same graph, for one experiment of every family."""

import jax
import numpy as np
import pytest
from flax import nnx

from nnx_zoo.common import experiments, models
from nnx_zoo.common.nn import keys

# One experiment of each family that declares its model (gpt2 has none that does).
EXPERIMENTS = [
  "bench/llama-19m",
  "diffusion/dit-digits",
  "lm/gemma2-2b",
  "seq2seq/shakespeare-spans",
  "speech/spoken-digits",
  "text/minilm-shakespeare-genre",
  "vision/clip-digits",
  "vision/vit-b16",
]


def test_the_stream_is_nnx_rngs_params_stream():
  ours, theirs = keys.Keys(7), nnx.Rngs(7)
  for _ in range(5):
    np.testing.assert_array_equal(
      jax.random.key_data(ours.params()), jax.random.key_data(theirs.params())
    )


@pytest.mark.parametrize("exp", EXPERIMENTS)
def test_a_model_has_the_weights_and_graph_nnx_rngs_gives(exp):
  cfg = models.upgrade(experiments.get_config(f"{exp}:smoke", resolve=False).model)
  cfg.lora.rank = 0
  want = models.family_module(cfg.family).Model(cfg, rngs=nnx.Rngs(5))
  got = models.build(cfg, seed=5)
  assert nnx.graphdef(got) == nnx.graphdef(want)
  got_leaves, want_leaves = jax.tree.leaves(nnx.state(got)), jax.tree.leaves(nnx.state(want))
  assert len(got_leaves) == len(want_leaves)
  for g, w in zip(got_leaves, want_leaves, strict=True):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
