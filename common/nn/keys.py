"""The random keys a model's weights are initialised from.

`Keys(seed).params()` gives the keys `nnx.Rngs(seed).params()` gives, bit for bit (the i-th is
`fold_in(key(seed), i)`), so the weights are the same; but it counts in Python instead of in an
`RngCount` variable. Under a trace (the train state built under jit, `models.abstract` under
eval_shape) every update of that variable asks the traced count for its `sharding`, and jax
(0.10) answers with an error whose message walks the whole trace so far: building a model took
time quadratic in its projections (SmolLM2's abstract build: 2.4 s, 0.6 s with `Keys`).

The layers take it as their `rngs` and call `rngs.params()` only; it holds no state that a
module keeps (no layer stores its `rngs`), so a model's graph is the one `nnx.Rngs` gives.
"""

import jax


class Keys:
  def __init__(self, seed: int):
    self._key = jax.random.key(seed)
    self._count = 0

  def params(self) -> jax.Array:
    """The next key of the stream."""
    key = jax.random.fold_in(self._key, self._count)
    self._count += 1
    return key
