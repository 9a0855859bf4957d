"""The trainer's sequence-to-sequence task on the smoke form of seq2seq/shakespeare-spans: the
loss against a numpy reference, the decoder's shifted inputs, resume exactness, and
`zoo generate` on an encoder-decoder workdir (and a T5 prompt in a decoder-only one)."""

import contextlib
import io
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnx_zoo.common import cli, config, experiments, models, tasks
from nnx_zoo.common.data import spans, tokenizers
from nnx_zoo.common.errors import UserError
from nnx_zoo.common.tasks import losses
from nnx_zoo.common.train import trainer
from nnx_zoo.zoo.t5 import model as t5

SMOKE = "seq2seq/shakespeare-spans:smoke"
# A constant schedule after a fixed warm-up does not depend on train.steps, so a run extended
# from 4 to 6 steps must match a 6-step run exactly; held-out loss at steps 3 and 6.
BASE = {
  "train.steps": "6",
  "train.checkpoint_every": "2",
  "train.log_every": "1",
  "train.eval_every": "3",
  "optim.schedule": "constant",
  "optim.warmup_steps": "2",
}


def smoke_config(overrides=None):
  return experiments.get_config(SMOKE, {**BASE, **(overrides or {})})


def records(workdir) -> list[dict]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f if line.strip()]


def test_shift_right_starts_each_target_segment():
  targets = jnp.asarray([[5, 6, 7, 8, 9, 0], [5, 6, 7, 8, 9, 4]])
  segments = jnp.asarray([[1, 1, 1, 1, 1, 0], [1, 1, 2, 2, 2, 2]])
  got = losses.shift_right(targets, segments, 3)
  np.testing.assert_array_equal(got, [[3, 5, 6, 7, 8, 3], [3, 5, 3, 7, 8, 9]])


@pytest.mark.slow
def test_seq2seq_loss_is_the_summed_cross_entropy_of_real_targets():
  model = models.build(t5.config("tiny", vocab_size=64), seed=0)
  rng = np.random.default_rng(0)
  batch = {
    "inputs": jnp.asarray(rng.integers(0, 64, (2, 9)), jnp.int32),
    "input_segment_ids": jnp.asarray([[1] * 9, [1] * 6 + [0] * 3]),
    "targets": jnp.asarray(rng.integers(0, 64, (2, 5)), jnp.int32),
    "target_segment_ids": jnp.asarray([[1] * 5, [1] * 3 + [0] * 2]),
  }
  total, count = tasks.get("seq2seq").loss_sums(model, batch)
  decoder = jnp.concatenate([jnp.zeros((2, 1), jnp.int32), batch["targets"][:, :-1]], axis=1)
  logits = np.asarray(
    model(batch["inputs"], decoder, segment_ids_BS=batch["input_segment_ids"]), np.float64
  )
  m = logits.max(-1, keepdims=True)
  log_z = (m + np.log(np.exp(logits - m).sum(-1, keepdims=True)))[..., 0]
  ce = log_z - np.take_along_axis(logits, np.asarray(batch["targets"])[..., None], -1)[..., 0]
  weights = np.asarray(batch["target_segment_ids"]) != 0
  assert float(count) == 8
  np.testing.assert_allclose(float(total), (ce * weights).sum(), rtol=1e-5)
  # The chunked head (train.loss_chunk) gives the same sum.
  chunked, _ = tasks.get("seq2seq").loss_sums(model, batch, loss_chunk=3)
  np.testing.assert_allclose(float(chunked), float(total), rtol=1e-5)


def test_seq2seq_data_on_a_decoder_is_one_clear_error():
  cfg = smoke_config()
  decoder = models.build(models.family_module("llama").config("tiny"))
  batch = {k: jnp.ones((1, 4), jnp.int32) for k in ("inputs", "input_segment_ids")}
  batch.update({k: jnp.ones((1, 3), jnp.int32) for k in ("targets", "target_segment_ids")})
  with pytest.raises(UserError, match="needs an encoder-decoder model"):
    tasks.get("seq2seq").loss_sums(decoder, batch)
  cfg.model.vocab_size = 256
  with pytest.raises(UserError, match="model.vocab_size=288 or more"):
    trainer.load_data(cfg)


def test_held_out_pairs_are_fixed_and_train_pairs_vary_by_epoch():
  cfg = smoke_config().data
  tok = tokenizers.load(cfg.tokenizer)
  a, b = spans.load_split(cfg, "eval", tok), spans.load_split(cfg, "eval", tok)
  for k in a.packed:
    np.testing.assert_array_equal(a.packed[k], b.packed[k])
  assert set(a.packed) == {"inputs", "input_segment_ids", "targets", "target_segment_ids"}
  rows = spans.load_split(cfg, "train", tok)
  sub = type(rows)({"tokens": rows.packed["tokens"][:4]}, "four")
  it = spans.train_iterator(sub, batch_size=4, seed=0, corrupt=spans.corrupter(cfg, tok))
  first, second = next(it), next(it)  # two epochs of the same four rows
  assert not np.array_equal(np.sort(first["inputs"], 0), np.sort(second["inputs"], 0))
  assert first["inputs"].shape == (4, cfg.seq_len)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("reference"))
  trainer.train(smoke_config(), workdir, progress=False)
  return workdir


@pytest.mark.slow
def test_resume_gives_the_same_losses_and_params(reference, tmp_path):
  from nnx_zoo.common.hub import weights

  workdir = str(tmp_path / "run")
  trainer.train(smoke_config({"train.steps": "4"}), workdir, progress=False)
  trainer.train(smoke_config(), workdir, progress=False)
  want = {r["step"]: r["loss"] for r in records(reference) if "split" not in r}
  got = {r["step"]: r["loss"] for r in records(workdir) if "split" not in r}
  assert got == want and len(want) == 6
  # The 4-step run also evaluated at its last step, 4.
  evals = {r["step"]: r["loss"] for r in records(workdir) if r.get("split") == "eval"}
  want_evals = {r["step"]: r["loss"] for r in records(reference) if r.get("split") == "eval"}
  assert sorted(want_evals) == [3, 6] and sorted(evals) == [3, 4, 6]
  assert {s: evals[s] for s in want_evals} == want_evals
  _, a, _ = weights.restore_params(smoke_config(), reference)
  _, b, _ = weights.restore_params(smoke_config(), workdir)
  for (k, x), (_, y) in zip(nnx.to_flat_state(a), nnx.to_flat_state(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x[...]), np.asarray(y[...]), err_msg=str(k))


def zoo(*argv) -> tuple[int, str, str]:
  out, err = io.StringIO(), io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    code = cli.main(list(argv))
  return code, out.getvalue(), err.getvalue()


@pytest.mark.slow
def test_generate_on_an_encoder_decoder_workdir(reference):
  code, out, err = zoo(
    "generate",
    "--workdir",
    reference,
    "--prompt",
    "ROMEO: <extra_id_0> light",
    "--max-new-tokens",
    "6",
    "--temperature",
    "0",
  )
  assert code == 0, err
  assert out.strip()


def test_t5_prompt_in_a_decoder_only_workdir_is_one_line(tmp_path):
  cfg = experiments.get_config("lm/shakespeare-char:smoke")
  (tmp_path / "config.json").write_text(config.to_json(cfg))
  code, out, err = zoo("generate", "--workdir", str(tmp_path), "--prompt", "a <extra_id_0> b")
  assert code == 2 and not out
  assert err.startswith("zoo: error: The prompt has T5 sentinels") and err.count("\n") == 1


def test_sentinel_prompts_round_trip():
  tok = tokenizers.load(tokenizers.config("bytes"))
  ids = spans.encode_prompt("ab<extra_id_0>c<extra_id_1>", tok, 288, 32)
  np.testing.assert_array_equal(ids, [97, 98, 287, 99, 286])
  assert spans.decode_output(ids, tok, 288, 32) == "ab<extra_id_0>c<extra_id_1>"
  with pytest.raises(UserError, match="beyond the data's 32 sentinels"):
    spans.encode_prompt("<extra_id_32>", tok, 288, 32)
