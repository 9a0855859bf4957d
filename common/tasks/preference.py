"""The dpo task: Direct Preference Optimization (Rafailov et al., 2023) on pairs of replies to one
prompt (`data.format="preference"`, common/data/pipeline.py `conversation_split`).

Per pair, with log-probabilities summed over each reply's tokens (the loss weights), the policy
being trained and the reference the frozen `init_from` weights:

    chosen_reward   = beta * (log pi(chosen)   - log ref(chosen))
    rejected_reward = beta * (log pi(rejected) - log ref(rejected))
    loss            = -log sigmoid(chosen_reward - rejected_reward)

The reference's log-probabilities of each batch come from a forward pass of the reference
model before the train step (`complete`), and ride in the batch as `reference` [B, 2] (one pair
a row), or [B, P, 2] with pairs packed several a row (`data.pairs_per_row="packed"`: per pair
slot of each row, `pair_slots`; the loss is the mean over the pairs a batch holds). The
reference holds no optimizer state and is placed on the mesh as the params are (`prepare`: the
init_from weights); under LoRA it is the base model without a copy (the params with every
adapter at zero: a fresh adapter changes nothing). Precomputing them once for every pair costs a
forward pass per pair instead of per visit: bench/dpo_reference.py measured that as the dearer
choice for a run that visits each pair about once (chat/shakespeare-dialogue-dpo: a fifth of an
epoch), so the zoo computes them per batch.

Held out: the loss, the mean rewards, their margin, `reward_accuracy` (chosen reward above
rejected) and `preference_accuracy`: the share of pairs whose chosen reply the model itself
finds likelier (no reference: comparable across models, e.g. an SFT model against its DPO run).
"""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from nnx_zoo.common import models, parallel, tasks
from nnx_zoo.common.errors import UserError
from nnx_zoo.common.tasks import losses, reference


def config(beta: float = 0.1) -> ml_collections.ConfigDict:
  """The `preference` section: `beta`, how far the policy may move from the reference (the
  KL penalty's inverse temperature)."""
  return ml_collections.ConfigDict({"beta": beta})


def sequence_logps(model, batch: dict, *, packed: bool = False, loss_chunk: int = 0) -> jax.Array:
  """The log-probability of each pair's chosen and rejected reply: the sum, over the reply's
  tokens (`loss_weights`), of each token's log-probability given what comes before it. [B, 2]
  for rows of one pair each; `packed` (`data.pairs_per_row="packed"`), [B, P, 2] per pair slot
  of each pair row (`pair_slots`). `loss_chunk` (train.loss_chunk): the head run that many
  tokens at a time, the [2B, L, V] logits never whole (`losses.decoder_token_logps`)."""
  B, _, L = batch["tokens"].shape
  flat = {k: batch[k].reshape(2 * B, L) for k in ("tokens", "segment_ids", "loss_weights")}
  rows = losses.next_token_rows(flat)
  inputs, pos, seg = rows["inputs"], rows["positions"], rows["segment_ids"]
  if loss_chunk:
    logp = losses.decoder_token_logps(
      model, inputs, seg, rows["targets"], chunk=loss_chunk, positions_BT=pos
    )
  else:
    logp = -parallel.cross_entropy(
      model(inputs, positions_BT=pos, segment_ids_BT=seg), rows["targets"]
    )
  if packed:
    return pair_slots(logp * rows["weights"], seg, B=B, L=L)
  return jnp.sum(logp * rows["weights"], axis=-1).reshape(B, 2)


def pair_slots(x_RT: jax.Array, segment_ids_RT: jax.Array, *, B: int, L: int) -> jax.Array:
  """[B, P, 2], P = L: the sums of `x_RT` over each conversation of B pair rows [2, L] (rows 2b
  and 2b + 1 of `x_RT` are pair row b's sides), by segment id: 2k + 1 is the k-th pair's chosen
  conversation, 2k + 2 its rejected one (`pipeline.pair_rows`); padding (0) adds to nothing, an
  empty slot sums to 0. A row's 2L tokens hold at most L pairs. Attention keeps the
  conversations apart, so a pair's sums are those of its conversations alone."""
  seg_BM = segment_ids_RT.reshape(B, -1)
  x_BM = jnp.where(seg_BM > 0, x_RT.reshape(B, -1), 0)
  index_BM = jnp.arange(B)[:, None] * 2 * L + jnp.clip(seg_BM - 1, 0, 2 * L - 1)
  sums = jax.ops.segment_sum(x_BM.ravel(), index_BM.ravel(), num_segments=B * 2 * L)
  return sums.reshape(B, L, 2)


class DPO(tasks.Task):
  name = "dpo"
  decoder = True
  rows_per_example = 2  # the chosen and the rejected reply

  def __init__(self, beta: float | None = None, *, packed: bool = False):
    self.beta, self.packed = beta, packed

  def _terms(self, model, batch, loss_chunk: int = 0):
    """Per pair ([B] one pair a row, [B, P] packed): the policy's log-probabilities [..., 2],
    the rewards, their margin, and which pairs count."""
    policy = sequence_logps(model, batch, packed=self.packed, loss_chunk=loss_chunk)
    rewards = self.beta * (policy - batch["reference"])
    margin = rewards[..., 0] - rewards[..., 1]
    # A pair counts with a reply token on both sides: not padding or an empty slot, nor a pair
    # whose reply the row's length cut away (prepared data keeps those; start-up drops them).
    weights = batch["loss_weights"]
    if self.packed:
      B, _, L = weights.shape
      flat = (weights.reshape(2 * B, L), batch["segment_ids"].reshape(2 * B, L))
      sides = pair_slots(*flat, B=B, L=L) > 0  # [B, P, 2]
    else:
      sides = jnp.sum(weights, axis=2) > 0  # [B, 2]
    pairs = jnp.all(sides, axis=-1).astype(jnp.float32)
    return policy, rewards, margin, pairs

  def loss_sums(self, model, batch, *, loss_chunk=0):
    """The summed loss over the batch's pairs, and their count: the step's mean is over the
    pairs its pair rows hold (with packed rows, as many as fit)."""
    _, _, margin, pairs = self._terms(model, batch, loss_chunk)
    return jnp.sum(-jax.nn.log_sigmoid(margin) * pairs), jnp.sum(pairs)

  def eval_sums(self, model, batch, *, prompts=None):
    policy, rewards, margin, pairs = self._terms(model, batch)
    return {
      "total": jnp.sum(-jax.nn.log_sigmoid(margin) * pairs),
      "count": jnp.sum(pairs),
      "chosen_reward": jnp.sum(rewards[..., 0] * pairs),
      "rejected_reward": jnp.sum(rewards[..., 1] * pairs),
      "reward_correct": jnp.sum((margin > 0) * pairs),
      "preferred": jnp.sum((policy[..., 0] > policy[..., 1]) * pairs),
    }

  def summary(self, sums):
    n = max(sums["count"], 1.0)
    chosen, rejected = sums["chosen_reward"] / n, sums["rejected_reward"] / n
    return {
      "loss": sums["total"] / n,
      "chosen_reward": chosen,
      "rejected_reward": rejected,
      "margin": chosen - rejected,
      "reward_accuracy": sums["reward_correct"] / n,
      "preference_accuracy": sums["preferred"] / n,
      "pairs": int(n),
    }

  def batch_shapes(self, cfg):
    B, L = cfg.train.batch_size, cfg.data.seq_len + 1
    shapes = {k: ((B, 2, L), np.int32) for k in ("tokens", "segment_ids")}
    reference = ((B, L, 2) if self.packed else (B, 2), np.float32)  # `sequence_logps`
    return {**shapes, "loss_weights": ((B, 2, L), np.float32), "reference": reference}

  def configure(self, cfg) -> "DPO":
    if "preference" not in cfg:
      raise UserError(
        "The dpo task reads cfg.preference.beta: add `c.preference = preference.config()` "
        "(nnx_zoo.common.tasks.preference)."
      )
    if cfg.data.format != "preference":
      raise UserError(
        "The dpo task trains on pairs of replies: set --config.data.format=preference (it is "
        f"{cfg.data.format!r})."
      )
    packed = cfg.data.get("pairs_per_row", "one") == "packed"
    return DPO(float(cfg.preference.beta), packed=packed)

  def prepare(self, data, *, cfg, layout=None) -> "DPO":
    """The reference model, ready for `complete`: the `init_from` weights placed on the mesh as
    the params are; under LoRA (training adapters only) none, the base being the params
    themselves with the adapters at zero."""
    if not cfg.init_from:
      raise UserError(
        "The dpo task trains against a reference model, the weights it starts from: set "
        "--config.init_from to an SFT run's workdir (or a converted checkpoint)."
      )
    graphdef = nnx.graphdef(models.abstract(cfg.model))
    self._reference = reference.Reference(cfg, layout)
    packed, chunk = self.packed, cfg.train.loss_chunk  # the reference's head chunked as well
    self._logps = jax.jit(
      lambda p, b: sequence_logps(nnx.merge(graphdef, p), b, packed=packed, loss_chunk=chunk)
    )
    return self

  def complete(self, batch, params):
    """The batch with `reference` ([B, 2], packed [B, P, 2]): the reference model's
    log-probabilities of its pairs (a forward pass, placed as the batch is)."""
    if not hasattr(self, "_logps"):
      raise RuntimeError("DPO.complete before prepare: the trainer prepares the task first.")
    return {**batch, "reference": self._logps(self._reference.params(params), batch)}


tasks.register(DPO())
