"""common/optim.py: the one-pass AdamW equals optax's chain (clip_by_global_norm + adamw) step for
step, keeps its state layout, and skips a step exactly."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from nnx_zoo.common.train import optim

HYPER = dict(b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)
SCHEDULE = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10, 1e-3)


def tree(seed: int, mean: float = 0.0):
  """A matrix, a vector and a 3-D kernel (decay applies to the matrix and the kernel only)."""
  k = jax.random.split(jax.random.key(seed), 3)
  return {
    "w": mean + jax.random.normal(k[0], (5, 3)),
    "scale": mean + 0.1 * jax.random.normal(k[1], (3,)),
    "block": {"kernel": mean + jax.random.normal(k[2], (2, 3, 4))},
  }


def run(tx, params, grads_per_step, *, fused: bool, scales):
  """Params and state after one step per (grads, scale): the chain is given the scaled
  gradients, the fused optimizer the unscaled ones and the scale."""
  state = tx.init(params)
  step = jax.jit(
    (lambda g, s, p, c: tx.update(g, s, p, grad_scale=c))
    if fused
    else (lambda g, s, p, c: tx.update(jax.tree.map(lambda x: x * c, g), s, p))
  )
  for grads, c in zip(grads_per_step, scales, strict=True):
    updates, state = step(grads, state, params, jnp.float32(c))
    params = optax.apply_updates(params, updates)
  return params, state


@pytest.mark.parametrize("clip_norm", [0.0, 1.0, 1e3])
def test_fused_adamw_equals_the_optax_chain_step_for_step(clip_norm):
  params = tree(0, mean=1.0)
  # Gradient norms from 1e-3 to ~100 after the trainer's 1/count scale (clipped at 1.0, not 1e3).
  sizes = [1e-3, 0.5, 3e3, 3, 2e5]
  grads = [jax.tree.map(lambda g, m=m: g * m, tree(s)) for s, m in enumerate(sizes, 1)]
  scales = [1.0, 0.5, 1 / 64, 1.0, 1 / 2048]
  kw = dict(HYPER, clip_norm=clip_norm)
  want_p, want_s = run(optim.reference(SCHEDULE, **kw), params, grads, fused=False, scales=scales)
  got_p, got_s = run(optim.adamw(SCHEDULE, **kw), params, grads, fused=True, scales=scales)
  assert jax.tree.structure(got_s) == jax.tree.structure(want_s)  # old checkpoints restore
  for got, want in [(got_p, want_p), (got_s, want_s)]:
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-7), got, want)
  assert not jax.tree.all(jax.tree.map(lambda a, b: np.array_equal(a, b), got_p, params))


def test_a_skipped_step_changes_nothing_and_does_not_count():
  params, grads = tree(0, mean=1.0), tree(1)
  tx = optim.adamw(SCHEDULE, **HYPER, clip_norm=1.0)
  state = tx.init(params)
  step = jax.jit(lambda g, s, p, ok: tx.update(g, s, p, apply=ok))
  updates, state = step(grads, state, params, True)  # moments no longer zero
  params = optax.apply_updates(params, updates)
  bad = jax.tree.map(lambda g: g.at[0].set(jnp.nan), grads)
  updates, kept = step(bad, state, params, False)
  assert jax.tree.all(jax.tree.map(lambda u: bool(jnp.all(u == 0)), updates))
  assert jax.tree.all(jax.tree.map(np.array_equal, optax.apply_updates(params, updates), params))
  assert jax.tree.all(jax.tree.map(np.array_equal, kept, state))
  # The next good step is the second step: the same as if the bad one had never come.
  after_skip = step(grads, kept, params, True)
  direct = step(grads, state, params, True)
  assert jax.tree.all(jax.tree.map(np.array_equal, after_skip, direct))


def test_grad_norm_given_is_used_for_clipping():
  """The trainer passes the norm it logs; a different norm must change the clipped step."""
  params, grads = tree(0, mean=1.0), tree(1)
  tx = optim.adamw(optax.constant_schedule(1e-2), **HYPER, clip_norm=1.0)
  state = tx.init(params)
  true_norm = optax.tree.norm(grads)
  same, _ = tx.update(grads, state, params, grad_norm=true_norm)
  computed, _ = tx.update(grads, state, params)
  jax.tree.map(np.testing.assert_array_equal, same, computed)
  # Adam's first step is sign-like, so compare the second step's size.
  _, s1 = tx.update(grads, state, params)
  a, _ = tx.update(grads, s1, params, grad_norm=true_norm)
  b, _ = tx.update(grads, s1, params, grad_norm=true_norm * 10)
  assert not np.allclose(a["w"], b["w"])
