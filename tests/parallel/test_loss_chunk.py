"""train.loss_chunk under data, FSDP and tensor (vocab-parallel) sharding: the chunked loss and
gradients equal the plain single-device ones (8 fake CPU devices, in a subprocess)."""

import numpy as np
import pytest

pytestmark = [pytest.mark.multidevice, pytest.mark.slow]
MESHES = [(1, 1, 2), (2, 2, 2), (1, 4, 2), (8, 1, 1)]

WORKER = """
import json, sys
import jax, numpy as np
from flax import nnx
from nnx_zoo.common import experiments, parallel
from nnx_zoo.common.train import trainer
from nnx_zoo.common.train import optim
from nnx_zoo.common.train import step as steps
from nnx_zoo.common import tasks

TASK = tasks.get("language_model")  # the task of every batch here

cfg = experiments.get_config("lm/shakespeare-char:smoke", {"train.batch_size": "8"})
cfg.model.tie_embeddings = sys.argv[1] == "tied"
tx = optim.optimizer(cfg.optim, cfg.train.steps)
graphdef, state = steps.init_state(cfg, tx)
rng = np.random.default_rng(0)
B, T = 8, cfg.data.seq_len + 1
batch = {"tokens": rng.integers(0, cfg.model.vocab_size, (B, T)).astype(np.int32),
         "segment_ids": np.where(np.arange(T) < T // 3, 1, 2).astype(np.int32)[None].repeat(B, 0)}
flat = lambda g: {"/".join(map(str, k)): np.asarray(v).tolist() for k, v in nnx.to_flat_state(g)}
sums, grads = jax.jit(lambda p, b: steps.sums_and_grads(p, b, graphdef=graphdef, task=TASK))(
    state.params, batch)
total = sums["total"]
out = {"plain": {"total": float(total), "grads": flat(grads)}}
for sizes in MESHES:
  layout = parallel.make_layout(dict(zip(("data", "fsdp", "tensor"), sizes)),
                                jax.devices()[: int(np.prod(sizes))])
  _, shardings = steps.placed_abstract_state(cfg, tx, layout)
  # 24 does not divide a device's 8 / (data x fsdp) x 32 tokens
  fn = jax.jit(lambda p, b, layout=layout: steps.sharded_sums_and_grads(
      p, b, graphdef=graphdef, task=TASK, layout=layout, loss_chunk=24))
  sums, grads = fn(jax.device_put(state.params, shardings.params), steps.put_batch(batch, layout))
  total = sums["total"]
  out[str(sizes)] = {"total": float(total), "grads": flat(grads)}
print(json.dumps(out))
"""


@pytest.fixture(scope="module", params=["untied", "tied"])
def results(request, forced_devices):
  return forced_devices.results(["-c", f"MESHES = {MESHES!r}\n" + WORKER, request.param])


@pytest.mark.parametrize("mesh", [str(m) for m in MESHES])
def test_chunked_sharded_equals_plain(results, mesh):
  ref, got = results["plain"], results[mesh]
  assert got["total"] == pytest.approx(ref["total"], rel=1e-5)
  for name, g in ref["grads"].items():
    g = np.asarray(g)
    np.testing.assert_allclose(
      np.asarray(got["grads"][name]), g, rtol=1e-4, atol=1e-5 * np.abs(g).max(), err_msg=name
    )
