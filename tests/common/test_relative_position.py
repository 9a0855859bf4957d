"""T5's relative position bias (position kind "relative") against transformers' T5Attention."""

import os
import pathlib
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnx_zoo.common.errors import UserError
from nnx_zoo.common.nn import position

torch = pytest.importorskip("torch")
t5 = pytest.importorskip("transformers.models.t5.modeling_t5")

ROOT = pathlib.Path(__file__).resolve().parents[2]
SETTINGS = [(32, 128), (16, 64), (8, 20), (32, 32), (10, 7)]  # (num_buckets, max_distance)


def hf_attention(num_heads, *, num_buckets, max_distance, bidirectional):
  cfg = t5.T5Config(
    d_model=8,
    d_kv=4,
    num_heads=num_heads,
    relative_attention_num_buckets=num_buckets,
    relative_attention_max_distance=max_distance,
    is_decoder=not bidirectional,
  )
  return t5.T5Attention(cfg, has_relative_attention_bias=True, layer_idx=0).eval()


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize(("num_buckets", "max_distance"), SETTINGS)
def test_buckets_equal_transformers(num_buckets, max_distance, bidirectional):
  relative = np.arange(-600, 601)  # every boundary of every setting, and far beyond
  want = t5.T5Attention._relative_position_bucket(
    torch.tensor(relative),
    bidirectional=bidirectional,
    num_buckets=num_buckets,
    max_distance=max_distance,
  ).numpy()
  got = position.relative_position_bucket(
    jnp.asarray(relative),
    bidirectional=bidirectional,
    num_buckets=num_buckets,
    max_distance=max_distance,
  )
  np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize("bidirectional", [True, False])
def test_bias_equals_transformers_compute_bias(bidirectional):
  N, T, S = 3, 40, 50
  cfg = position.config("relative", num_buckets=16, max_distance=24, bidirectional=bidirectional)
  pos = position.make(cfg, head_dim=4, dim=8, num_heads=N, rngs=nnx.Rngs(0))
  assert isinstance(pos, position.RelativeBias)
  hf = hf_attention(N, num_buckets=16, max_distance=24, bidirectional=bidirectional)
  with torch.no_grad():  # the same table in both: HF's layout [buckets, N] is ours
    hf.relative_attention_bias.weight.copy_(torch.tensor(np.asarray(pos.table[...])))
    # Queries T at positions 10..49 against keys 0..49: a decoding step after 10 cached tokens.
    want = hf.compute_bias(T, S, past_seen_tokens=S - T).numpy()  # [1, N, T, S]
  q_pos_BT = jnp.broadcast_to(jnp.arange(S - T, S), (2, T))
  k_pos_BS = jnp.broadcast_to(jnp.arange(S), (2, S))
  got = pos.logit_bias(q_pos_BT, k_pos_BS, N)
  assert got.shape == (2, N, T, S)
  np.testing.assert_array_equal(np.asarray(got), np.broadcast_to(want, (2, N, T, S)))


def test_bias_follows_each_rows_positions():
  """Packed rows: positions restart per segment, and the bias reads them, not the indices."""
  cfg = position.config("relative", num_buckets=8, max_distance=16)
  pos = position.make(cfg, head_dim=4, dim=8, num_heads=2, rngs=nnx.Rngs(1))
  positions_BT = jnp.asarray([[0, 1, 2, 0, 1, 2]])
  got = np.asarray(pos.logit_bias(positions_BT, positions_BT, 2))
  table = np.asarray(pos.table[...])
  rel = np.asarray(positions_BT[0])[None, :] - np.asarray(positions_BT[0])[:, None]
  bucket = t5.T5Attention._relative_position_bucket(
    torch.tensor(rel), bidirectional=True, num_buckets=8, max_distance=16
  ).numpy()
  np.testing.assert_array_equal(got[0], np.transpose(table[bucket], (2, 0, 1)))


def test_config_defaults_and_errors():
  cfg = position.config("relative")
  assert (cfg.num_buckets, cfg.max_distance, cfg.bidirectional) == (32, 128, True)
  with pytest.raises(UserError, match="num_heads"):
    position.make(cfg, head_dim=4, dim=8, rngs=nnx.Rngs(0))
  with pytest.raises(UserError, match="takes no"):
    position.config("relative", theta=1.0)
  pos = position.make(cfg, head_dim=4, dim=64, num_heads=6, rngs=nnx.Rngs(0))
  assert pos.table.shape == (32, 6) and pos.table.axes == (None, "NH")
  # T5's init: normal with std d_model ** -0.5.
  assert np.std(np.asarray(pos.table[...])) == pytest.approx(64**-0.5, rel=0.2)
  # The other kinds answer nothing here, and relative nothing to embed or rotate.
  x = jnp.ones((1, 3, 2, 4))
  assert pos.rotate(x, jnp.zeros((1, 3), jnp.int32)) is x


TENSOR_SPLIT = textwrap.dedent(
  """
  import jax, jax.numpy as jnp, numpy as np
  from flax import nnx
  from nnx_zoo.common import parallel
  from nnx_zoo.common.nn import position

  N, T = 4, 6
  cfg = position.config("relative", num_buckets=8, max_distance=16, bidirectional=False)
  graphdef, state = nnx.split(position.make(cfg, head_dim=4, dim=8, num_heads=N, rngs=nnx.Rngs(0)))
  q_BT = jnp.broadcast_to(jnp.arange(T), (2, T))
  weights = jax.random.normal(jax.random.key(1), (2, N, T, T))

  def bias(state):  # what attention does with it: its own heads' slice
    return parallel.local_heads(nnx.merge(graphdef, state).logit_bias(q_BT, q_BT, N), axis=1)

  def loss(state):
    return jnp.sum(bias(state) * parallel.local_heads(weights, axis=1))

  want, want_grad = bias(state), jax.grad(loss)(state)
  layout = parallel.make_layout({"data": 1, "fsdp": 1, "tensor": 2})
  specs = layout.param_specs(state)

  def local(state):
    with parallel.active(layout):
      return bias(state), jax.grad(loss)(state)

  got, grad = jax.jit(jax.shard_map(
    local, mesh=layout.mesh, in_specs=(specs,), out_specs=(parallel.P(None, "tensor"), specs),
    check_vma=True,
  ))(state)
  assert specs["table"].value == parallel.P(None, "tensor"), specs
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  np.testing.assert_allclose(
    np.asarray(grad["table"][...]), np.asarray(want_grad["table"][...]), rtol=1e-6
  )
  print("ok")
  """
)


@pytest.mark.slow
@pytest.mark.multidevice
def test_heads_split_over_tensor_give_each_device_its_heads():
  """The table is stored split over `tensor`: each device gets the bias of its own heads (after
  attention's `local_heads`), and the table's gradient equals one device's."""
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
  proc = subprocess.run(
    [sys.executable, "-P", "-c", TENSOR_SPLIT], cwd=ROOT, env=env, capture_output=True, text=True
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.strip().endswith("ok")
