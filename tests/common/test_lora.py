"""LoRA: a fresh adapter changes nothing; training moves only the adapters (and what lora.train
names) and the optimizer holds state for nothing else; merging equals the unmerged model; a
merged export loads in transformers with the unmerged model's logits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnx_zoo.common import experiments, hub, models, tasks
from nnx_zoo.common.errors import UserError
from nnx_zoo.common.hub import weights
from nnx_zoo.common.nn import lora, stacking
from nnx_zoo.common.train import optim, trainer
from nnx_zoo.common.train import step as steps
from nnx_zoo.zoo.bert import model as bert
from nnx_zoo.zoo.llama import model as llama

TASK = tasks.get("language_model")  # the task of every batch here

TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 16)), jnp.int32)


def llama_cfg(**lora_kw):
  cfg = llama.config("tiny", num_kv_heads=2)
  cfg.lora = lora.config(**lora_kw)
  return cfg


def perturbed(model):
  """Nonzero B, so the adapters change the outputs."""
  for path, x in nnx.to_flat_state(nnx.state(model, lora.LoRAParam)):
    if path[-1] == "b":
      x[...] = jax.random.normal(jax.random.key(len(path)), x[...].shape) * 0.1
  return model


def test_fresh_adapters_change_nothing():
  base = models.build(llama_cfg())
  adapted = models.build(llama_cfg(rank=4, targets="attn.q,attn.v,mlp.*"))
  np.testing.assert_array_equal(np.asarray(base(TOKENS)), np.asarray(adapted(TOKENS)))
  paths = {
    ".".join(map(str, p[:-1])) for p, _ in nnx.to_flat_state(nnx.state(adapted, lora.LoRAParam))
  }
  assert "blocks.0.attn.q.lora" in paths and "blocks.1.mlp.down.lora" in paths
  assert not any(".attn.k." in p or ".attn.o." in p for p in paths)


def test_adapter_is_low_rank_update_of_the_kernel():
  """y = x W + (alpha / r) x A B, checked against numpy on one projection."""
  model = perturbed(models.build(llama_cfg(rank=2, alpha=8.0, targets="attn.q")))
  q = model.blocks[0].attn.q
  x = np.random.default_rng(1).normal(size=(3, q.in_features)).astype(np.float32)
  want = x @ np.asarray(q.kernel[...]) + 4.0 * (
    x @ np.asarray(q.lora.a[...]) @ np.asarray(q.lora.b[...])
  )
  np.testing.assert_allclose(np.asarray(q(jnp.asarray(x))), want, rtol=1e-5, atol=1e-5)


def test_merge_equals_the_unmerged_model():
  model = perturbed(models.build(llama_cfg(rank=4)))
  before = np.asarray(model(TOKENS))
  lora.merge(model)
  assert not jax.tree.leaves(nnx.state(model, lora.LoRAParam))
  np.testing.assert_allclose(np.asarray(model(TOKENS)), before, rtol=1e-5, atol=1e-5)


def test_targets_matching_nothing_name_the_projections():
  with pytest.raises(UserError, match=r"matches no projection.*attn\.q.*mlp\.up"):
    models.build(llama_cfg(rank=4, targets="attention.query"))


def test_a_train_step_moves_only_adapters_and_named_params():
  cfg = experiments.get_config("lm/shakespeare-char:smoke")
  cfg.model.lora = lora.config(rank=4, targets="attn.q,attn.v", train="norm.*")
  cfg.optim.warmup_steps = 0
  tx = optim.optimizer(cfg.optim, 10)
  graphdef, state = steps.init_state(cfg, tx)
  trainable = lora.trainable(cfg.model)
  trained_part, _ = nnx.split_state(state.params, trainable, ...)
  trained = {k for k, _ in nnx.to_flat_state(trained_part)}
  # The optimizer holds moments for the trained parameters only.
  moments = [x for x in jax.tree.leaves(state.opt_state) if getattr(x, "ndim", 0) > 0]
  assert sum(x.size for x in moments) == 2 * sum(x.size for x in jax.tree.leaves(trained_part))

  step = jax.jit(
    lambda s, b: steps.train_step(s, b, graphdef=graphdef, task=TASK, tx=tx, trainable=trainable)
  )
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (4, 33)), jnp.int32)
  before = {k: np.asarray(v[...]) for k, v in nnx.to_flat_state(state.params)}
  new, metrics = step(state, {"tokens": tokens, "segment_ids": jnp.ones_like(tokens)})
  assert np.isfinite(float(metrics["loss"]))
  changed = {
    k for k, v in nnx.to_flat_state(new.params) if not np.array_equal(np.asarray(v[...]), before[k])
  }
  assert changed == trained
  assert any("lora" in k for k in changed) and ("norm", "scale") in changed


@pytest.mark.slow
def test_lora_run_exports_merged_and_loads_in_transformers(tmp_path):
  """A LoRA run (bert classifier, adapters on q/v, head trained) exports as
  BertForSequenceClassification whose logits equal our unmerged model's."""
  import torch
  import transformers

  cfg = experiments.get_config("text/minilm-shakespeare-genre:smoke")
  cfg.model.lora = lora.config(rank=4, targets="attn.q,attn.v", train="head.*,pooler.*")
  cfg.optim.update(lr=1e-2, warmup_steps=0)
  trainer.train(cfg, str(tmp_path / "run"), progress=False)

  # The run's own (unmerged) model, from its checkpoint.
  graphdef, params, _ = weights.restore_params(cfg, str(tmp_path / "run"))
  ours = nnx.merge(graphdef, params)
  b = np.asarray(ours.blocks[0].attn.q.lora.b[...])
  assert np.abs(b).max() > 0  # the adapters trained

  hub.export_hf(str(tmp_path / "run"), str(tmp_path / "ex"))
  back = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "ex").eval()
  tokens = np.random.default_rng(0).integers(1, 256, (3, 10))
  mask = np.ones_like(tokens)
  mask[1, -3:] = 0
  with torch.no_grad():
    ref = back(torch.tensor(tokens), attention_mask=torch.tensor(mask)).logits.numpy()
  got = ours.classify(jnp.asarray(tokens), attention_mask=jnp.asarray(mask))
  np.testing.assert_allclose(np.asarray(got), ref, atol=1e-4)


def test_bert_lora_targets():
  cfg = bert.config("tiny")
  cfg.lora = lora.config(rank=2, targets="mlp.up")
  model = models.build(cfg)
  assert model.blocks[0].mlp.up.lora is not None and model.blocks[0].attn.q.lora is None


@pytest.mark.slow  # 13-17 s: the quick suite's budget
def test_lora_on_layers_stored_stacked():
  """model.scan stores the layers stacked: the adapters of a stacked projection are stacked
  too, with the unscanned model's values (same seed); per layer, the scanned model's outputs,
  adapter gradients and merged weights are the unscanned model's."""
  cfg = llama_cfg(rank=4, targets="attn.q,mlp.*")
  scan_cfg = cfg.copy_and_resolve_references()
  scan_cfg.scan = True
  plain, scanned = models.build(cfg), models.build(scan_cfg)
  stacked = nnx.state(scanned, lora.LoRAParam)
  assert ("stacked", 0, "attn", "q", "lora", "a") in dict(nnx.to_flat_state(stacked))
  want = dict(nnx.to_flat_state(nnx.state(plain, lora.LoRAParam)))
  got = dict(nnx.to_flat_state(stacking.unstack_layers(stacked)))
  assert got.keys() == want.keys()
  for k in want:
    np.testing.assert_array_equal(np.asarray(got[k][...]), np.asarray(want[k][...]), str(k))
  perturbed(plain)
  nnx.update(scanned, stacking.match_layers(nnx.state(plain), scanned))
  np.testing.assert_allclose(scanned(TOKENS), plain(TOKENS), rtol=1e-5, atol=1e-5)

  def grads(model):
    graphdef, trained, frozen = nnx.split(model, lora.LoRAParam, ...)
    f = lambda t: jnp.sum(jnp.sin(nnx.merge(graphdef, t, frozen)(TOKENS)))
    return jax.grad(f)(trained)

  got, want = stacking.unstack_layers(grads(scanned)), grads(plain)
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-5 * float(jnp.max(jnp.abs(y))))
  lora.merge(plain)
  lora.merge(scanned)
  np.testing.assert_allclose(scanned(TOKENS), plain(TOKENS), rtol=1e-5, atol=1e-5)
  # A target naming some layers of a stacked projection only cannot be stacked.
  one_layer = dict(targets="blocks.1.attn.q", rank=4)
  assert models.build(llama_cfg(**one_layer)).blocks[1].attn.q.lora is not None
  one_layer_scanned = llama_cfg(**one_layer)
  one_layer_scanned.scan = True
  with pytest.raises(UserError, match="some layers only"):
    models.build(one_layer_scanned)
