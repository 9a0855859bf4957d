"""Context parallelism's single-device pieces: the balanced token order, attention of a device's
tokens against the whole row (against `attend` in the natural order), and the errors a context
mesh can cause. The sharded step itself: tests/parallel/test_context_parallel.py."""

import functools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from nnx_zoo.common import mesh, parallel
from nnx_zoo.common.errors import UserError
from nnx_zoo.common.nn import attention_ref
from nnx_zoo.common.tasks import losses
from nnx_zoo.common.train import step as steps


@pytest.mark.parametrize("context", [1, 2, 4, 8])
def test_context_order_is_a_permutation_balanced_under_a_causal_mask(context):
  T = 64
  order = parallel.context_order(T, context)
  assert sorted(order.tolist()) == list(range(T))
  # The (query, key) pairs a causal mask leaves each device: query t sees t + 1 keys.
  work = [int(np.sum(chunk + 1)) for chunk in order.reshape(context, -1)]
  assert len(set(work)) == 1, work
  # Each device's tokens are two runs of consecutive indices, one from each end.
  if context > 1:
    first = order.reshape(context, -1)[0]
    assert first[0] == 0 and first[-1] == T - 1


def test_context_order_refuses_a_length_that_does_not_split():
  with pytest.raises(UserError, match="data.seq_len to a multiple of 8"):
    parallel.context_order(36, 4)


def natural_attention(q, k, v, seg, *, causal, window, softcap):
  T = q.shape[1]
  mask = attention_ref.make_mask(
    jnp.arange(T), jnp.arange(T), seg, seg, causal=causal, window=window
  )
  return attention_ref.attend(q, k, v, mask_BTS=mask, softcap=softcap)


@pytest.mark.parametrize(
  "T,C,causal,window,softcap",
  [
    (64, 4, True, 0, 0.0),
    (64, 4, True, 24, 0.0),
    (64, 4, False, 0, 20.0),
    (64, 4, False, 40, 0.0),
    (512, 2, True, 24, 0.0),  # 256 queries on the device: the blocks' rematerialised loop runs
  ],
)
def test_a_device_attending_to_the_whole_row_equals_the_row_in_order(T, C, causal, window, softcap):
  """Device 1 of C holds the tokens `context_order` gives it and the gathered keys of the row
  (in that order too): its outputs and their gradients are the rows of the natural-order
  attention at those indices (GQA: 4 query heads on 2 key/value heads; two documents a row)."""
  B, N, K, H = 2, 4, 2, 8
  keys = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(keys[0], (B, T, N, H))
  k = jax.random.normal(keys[1], (B, T, K, H))
  v = jax.random.normal(keys[2], (B, T, K, H))
  seg = jnp.asarray(np.where(np.arange(T) < T // 3, 1, 2)[None].repeat(B, 0))
  order = parallel.context_order(T, C)
  mine = order.reshape(C, -1)[1]  # device 1's tokens

  def natural(q, k, v):
    out = natural_attention(q, k, v, seg, causal=causal, window=window, softcap=softcap)
    return out[:, mine]

  def gathered(q, k, v):
    return attention_ref.attend_gathered(
      q[:, mine],
      k[:, order],
      v[:, order],
      q_idx_T=jnp.asarray(mine),
      k_idx_S=jnp.asarray(order),
      q_seg_BT=seg[:, mine],
      k_seg_BS=seg[:, order],
      causal=causal,
      window=window,
      softcap=softcap,
    )

  cot = jax.random.normal(jax.random.key(1), (B, len(mine), N, H))

  @functools.partial(jax.jit, static_argnums=0)  # one program each, not one per op
  def out_and_grads(f, q, k, v):
    return f(q, k, v), jax.grad(lambda *a: jnp.sum(f(*a) * cot), argnums=(0, 1, 2))(q, k, v)

  got, g_got = out_and_grads(gathered, q, k, v)
  want, g_nat = out_and_grads(natural, q, k, v)
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
  for a, b in zip(g_got, g_nat, strict=True):
    np.testing.assert_allclose(a, b, atol=5e-5, rtol=1e-4)


def test_mesh_has_a_context_axis():
  cfg = mesh.config(context=-1, tensor=2)
  assert mesh.resolve(cfg, 8) == {
    "pipeline": 1,
    "data": 1,
    "fsdp": 1,
    "expert": 1,
    "context": 4,
    "tensor": 2,
  }
  # A config saved before the axis existed: context 1.
  old = ml_collections.ConfigDict({"data": 2, "fsdp": 2, "expert": 1, "tensor": 2})
  assert mesh.resolve(old, 8)["context"] == 1


def test_a_context_mesh_names_a_row_length_that_does_not_split():
  from nnx_zoo.zoo.llama import model as llama

  cfg = llama.config("tiny")
  sizes = {"data": 1, "fsdp": 1, "expert": 1, "context": 4, "tensor": 1}
  with pytest.raises(UserError, match=r"data.seq_len=36 does not split into 2 x context = 8"):
    parallel.check_fits(cfg, sizes, batch_size=4, seq_len=36)
  with pytest.raises(UserError, match="no token rows to split: keep mesh.context=1"):
    parallel.check_fits(cfg, sizes, batch_size=4, seq_len=0)
  parallel.check_fits(cfg, sizes, batch_size=4, seq_len=64)


def test_a_batch_that_is_not_token_rows_refuses_a_context_mesh():
  layout = parallel.make_layout({"context": 1})  # one CPU device: the sizes say 1, patch them
  sizes = {**layout.sizes, "context": 2}
  fake = type("FakeLayout", (), {"sizes": sizes, "batch_spec": layout.batch_spec})()
  images = {"images": np.zeros((2, 8, 8, 1)), "labels": np.zeros(2, np.int32)}
  with pytest.raises(UserError, match="set mesh.context=1"):
    steps.context_rows(images, fake)


def test_next_token_rows_made_on_the_host_equal_those_made_in_the_step():
  """`step.put_batch` makes a context mesh's next-token rows with NumPy on the host; the step
  makes them with jnp from whole rows. Same values, same dtypes."""
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 50, (3, 17)).astype(np.int32)
  segments = np.array([[1] * 5 + [2] * 12, [1] * 17, [1] * 9 + [2] * 4 + [0] * 4], np.int32)
  batch = {"tokens": tokens, "segment_ids": segments}
  host = losses.next_token_rows(batch)
  device = losses.next_token_rows(jax.tree.map(jnp.asarray, batch))
  assert all(isinstance(v, np.ndarray) for v in host.values())
  for k in device:
    assert host[k].dtype == device[k].dtype, k
    np.testing.assert_array_equal(host[k], np.asarray(device[k]), err_msg=k)
  np.testing.assert_array_equal(host["positions"][2], [*range(9), 0, 1, 2, 3, 0, 1, 2])
