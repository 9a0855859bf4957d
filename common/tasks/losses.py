"""The trainer's task losses (next-token cross-entropy, an encoder-decoder's target
cross-entropy, classification of rows or images, CLIP's contrastive loss), and the same
cross-entropy through the output projection a chunk of tokens at a time, so the [tokens, V]
logits and their gradient never exist whole (`train.loss_chunk`, 0 = off).

Shapes: M tokens of the flattened batch (B x T), J chunks of C tokens each (M = J x C after
padding), V vocab, D width.

Each chunk's logits are computed, turned into the chunk's loss and into the gradient of that
loss with respect to the head's weights and inputs, and dropped: the gradient is computed in the
forward pass (a custom VJP whose backward only scales it), so the head's matmuls run three
times, as without chunks, never four. With a 32k vocab the logits are the largest array of a
small model's step, and keeping one chunk of them in cache is faster as well as smaller
(bench/train_vs_torch.py). Works with the vocab-parallel head of common/parallel.py: each
device handles its slice of the vocab and the softmax is assembled as in
`parallel.cross_entropy`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from nnx_zoo.common import parallel
from nnx_zoo.common.errors import UserError
from nnx_zoo.common.nn import position
from nnx_zoo.common.nn.encoder_decoder import EncoderDecoder
from nnx_zoo.common.tasks import contrastive_loss


def cross_entropy_and_grad(logits_MV: jax.Array, targets_M: jax.Array):
  """Per-token cross-entropy [M] and its gradient with respect to the logits [M, V] (this
  device's vocab slice when the vocab is split over `tensor`)."""
  logits = logits_MV.astype(jnp.float32)
  v_local = logits.shape[-1]
  if parallel.tensor_split("V"):
    local_targets = targets_M - parallel.tensor_index() * v_local
    m = parallel.pmax_tensor(jnp.max(logits, axis=-1))
    lse = jnp.log(parallel.psum_tensor(jnp.sum(jnp.exp(logits - m[:, None]), axis=-1))) + m
  else:
    local_targets = targets_M
    lse = jax.nn.logsumexp(logits, axis=-1)
  # No hit in this slice when the target lies in another device's slice of the vocab.
  hit = local_targets[:, None] == jnp.arange(v_local, dtype=local_targets.dtype)
  target_logit = jnp.sum(jnp.where(hit, logits, 0.0), axis=-1)
  if parallel.tensor_split("V"):
    target_logit = parallel.psum_tensor(target_logit)
  return lse - target_logit, jnp.exp(logits - lse[:, None]) - hit


def head_cross_entropy_sum(
  head: nnx.Module, project, x_MD: jax.Array, targets_M, weights_M, *, chunk: int
) -> jax.Array:
  """sum_n weights_M[n] * CE(project(head, x_MD[n]), targets_M[n]), `chunk` tokens at a time.

  `head` is the module holding the model's output projection (its `lm_head`, or the embedding
  whose `attend` is the tied head) and `project(head, x)` the logits it gives, soft-cap
  included (`nnx_zoo.common.nn.transformer.Decoder.output_head`); its parameters and `x_MD` get
  gradients, `targets_M` and `weights_M` not.
  """
  M, D = x_MD.shape
  pad = -M % chunk
  if pad:  # padded tokens weigh 0
    x_MD = jnp.pad(x_MD, ((0, pad), (0, 0)))
    targets_M, weights_M = jnp.pad(targets_M, (0, pad)), jnp.pad(weights_M, (0, pad))
  graphdef, params, rest = nnx.split(head, nnx.Param, ...)
  rest = jax.lax.stop_gradient(rest)
  targets_JC = targets_M.reshape(-1, chunk)
  weights_JC = weights_M.astype(jnp.float32).reshape(-1, chunk)
  varying = {}  # what the primal inputs vary over, read when tracing the forward pass

  def apply(params, x_CD):
    return project(nnx.merge(graphdef, params, rest), x_CD)

  def forward(params, x_MD):
    varying["params"] = jax.tree.map(parallel.varying, params)
    varying["x"] = parallel.varying(x_MD)
    # The weights' gradient is summed over this device's chunks first, over devices at the end.
    params = jax.tree.map(lambda p: parallel.to_varying(p, parallel.varying(x_MD)), params)

    def body(dparams, chunk_in):
      x_CD, targets_C, weights_C = chunk_in
      logits_CV, vjp = jax.vjp(apply, params, x_CD)
      ce_C, dlogits_CV = cross_entropy_and_grad(logits_CV, targets_C)
      dp, dx_CD = vjp((dlogits_CV * weights_C[:, None]).astype(logits_CV.dtype))
      return jax.tree.map(jnp.add, dparams, dp), (jnp.sum(ce_C * weights_C), dx_CD)

    xs = (x_MD.reshape(-1, chunk, D), targets_JC, weights_JC)
    dparams, (sums, dx) = jax.lax.scan(body, jax.tree.map(jnp.zeros_like, params), xs)
    return jnp.sum(sums), (dparams, dx.reshape(-1, D))

  @jax.custom_vjp
  def total(params, x_MD):  # the value alone (no gradient asked for): no vjp per chunk
    def body(_, chunk_in):
      x_CD, targets_C, weights_C = chunk_in
      ce_C, _ = cross_entropy_and_grad(apply(params, x_CD), targets_C)
      return None, jnp.sum(ce_C * weights_C)

    xs = (x_MD.reshape(-1, chunk, D), targets_JC, weights_JC)
    return jnp.sum(jax.lax.scan(body, None, xs)[1])

  def backward(res, g):
    dparams, dx = res
    dparams = jax.tree.map(lambda d, v: parallel.sum_to(d * g, v), dparams, varying["params"])
    return dparams, parallel.sum_to((dx * g).astype(x_MD.dtype), varying["x"])

  total.defvjp(forward, backward)
  return total(params, x_MD)


def hidden_and_head(model, inputs_BT, segment_ids_BT, positions_BT):
  """A decoder's `hidden` states [B, T, D] and its output head (`output_head`: the module and
  the projection, the same as its `logits`, soft-cap included)."""
  if not hasattr(model, "output_head"):
    raise UserError(
      f"train.loss_chunk needs a decoder with an output head ({type(model).__name__} has "
      "none): set --config.train.loss_chunk=0."
    )
  x_BTD, _ = model.hidden(inputs_BT, positions_BT=positions_BT, segment_ids_BT=segment_ids_BT)
  return x_BTD, *model.output_head()


def decoder_token_map(
  model, inputs_BT, segment_ids_BT, fn, *, chunk: int, positions_BT=None, xs=(), consts=None
):
  """`fn(logits_CV, consts, *xs_C)` per token of the rows, the decoder's head run `chunk` tokens
  at a time: each chunk's logits (float32) are made, reduced by `fn` to per-token values (a
  tuple of [C] arrays) and dropped, and made again in the backward pass (`jax.checkpoint`), so
  the [B, T, V] logits and their gradient never exist whole. `xs`: arrays [B, T, ...] cut into
  the chunks beside the tokens; `consts`: a pytree every chunk sees whole (a teacher's head).
  Returns `fn`'s outputs as [B, T] arrays. For losses that are not a sum of cross-entropies
  (GRPO's ratios, DPO's sequence sums, a distillation divergence), where
  `head_cross_entropy_sum`'s gradient-in-the-forward does not apply: the head's matmuls run four
  times a chunk, not three."""
  x_BTD, head, project = hidden_and_head(model, inputs_BT, segment_ids_BT, positions_BT)
  B, T, D = x_BTD.shape
  M = B * T
  chunk = min(chunk, M)
  pad = -M % chunk

  def chunks(a_BT):  # [B, T, ...] -> [J, C, ...]
    a_M = a_BT.reshape(M, *a_BT.shape[2:])
    return jnp.pad(a_M, [(0, pad)] + [(0, 0)] * (a_M.ndim - 1)).reshape(-1, chunk, *a_M.shape[1:])

  graphdef, params, rest = nnx.split(head, nnx.Param, ...)

  @jax.checkpoint
  def one(params, consts, x_CD, xs_C):
    logits_CV = project(nnx.merge(graphdef, params, rest), x_CD).astype(jnp.float32)
    return fn(logits_CV, consts, *xs_C)

  out_J = jax.lax.map(lambda a: one(params, consts, *a), (chunks(x_BTD), tuple(map(chunks, xs))))
  return tuple(o.reshape(-1)[:M].reshape(B, T) for o in out_J)


def decoder_token_logps(
  model,
  inputs_BT,
  segment_ids_BT,
  targets_BT,
  *,
  chunk: int,
  positions_BT=None,
  temperature: float = 1.0,
) -> jax.Array:
  """[B, T] log-probability of each target under the logits / `temperature`, the head run
  `chunk` tokens at a time (`decoder_token_map`)."""

  def logps(logits_CV, _, targets_C):
    return (-parallel.cross_entropy(logits_CV / temperature, targets_C),)

  (out,) = decoder_token_map(
    model, inputs_BT, segment_ids_BT, logps, chunk=chunk, positions_BT=positions_BT,
    xs=(targets_BT,),
  )  # fmt: skip
  return out


def decoder_sums(
  model, inputs_BT, segment_ids_BT, targets_BT, weights_BT, *, chunk: int, positions_BT=None
):
  """`loss_sums`'s summed loss with the head run `chunk` tokens at a time: the decoder's
  `hidden` states, then its output head (`output_head`, the same projection and soft-cap as
  its `logits`) chunk by chunk."""
  x_BTD, head, project = hidden_and_head(model, inputs_BT, segment_ids_BT, positions_BT)
  B, T, D = x_BTD.shape
  return head_cross_entropy_sum(
    head,
    project,
    x_BTD.reshape(B * T, D),
    targets_BT.reshape(-1),
    weights_BT.reshape(-1),
    chunk=min(chunk, B * T),
  )


# The trainer's task losses: summed over the batch, with the count they are the mean over.


def next_token_rows(batch: dict) -> dict:
  """A language model's view of packed rows {"tokens", "segment_ids"} [B, T + 1] (and, where the
  data weighs its tokens, "loss_weights"): `inputs`, `targets` (the next tokens), `segment_ids`
  and `positions` (each input's index in its own document) and `weights` [B, T]. A target counts
  only when it continues the segment of its input (no predicting across a document boundary),
  is not padding, and by its own loss weight. Computed from whole rows, so that they can then be
  split over `mesh.context` (NumPy in, NumPy out: the host makes them for `step.put_batch`)."""
  tokens, segments = batch["tokens"], batch["segment_ids"]
  in_seg_BT = segments[:, :-1]
  weights_BT = ((segments[:, 1:] == in_seg_BT) & (in_seg_BT != 0)).astype(np.float32)
  if "loss_weights" in batch:  # each token's own weight as a target (chat: the assistant's)
    weights_BT = weights_BT * batch["loss_weights"][:, 1:]
  return {
    "inputs": tokens[:, :-1],
    "targets": tokens[:, 1:],
    "segment_ids": in_seg_BT,
    "positions": position.positions_from_segments(in_seg_BT),
    "weights": weights_BT,
  }


def loss_sums(model, batch: dict, *, loss_chunk: int = 0) -> tuple[jax.Array, jax.Array]:
  """Summed next-token cross-entropy over a batch of packed rows, and the number of targets:
  over `next_token_rows(batch)`, or over `batch["next_token"]` when the sharded step made them
  (and split them over `mesh.context`)."""
  rows = batch["next_token"] if "next_token" in batch else next_token_rows(batch)
  inputs_BT, targets_BT, weights_BT = rows["inputs"], rows["targets"], rows["weights"]
  seg_BT, pos_BT = rows["segment_ids"], rows["positions"]
  if loss_chunk:  # train.loss_chunk: the [B, T, V] logits never held whole
    total = decoder_sums(
      model, inputs_BT, seg_BT, targets_BT, weights_BT, chunk=loss_chunk, positions_BT=pos_BT
    )
    return total, jnp.sum(weights_BT)
  logits_BTV = model(inputs_BT, positions_BT=pos_BT, segment_ids_BT=seg_BT)
  ce_BT = parallel.cross_entropy(logits_BTV, targets_BT)
  return jnp.sum(ce_BT * weights_BT), jnp.sum(weights_BT)


def classify_rows(model, batch: dict) -> tuple[jax.Array, jax.Array, jax.Array]:
  """A classifier's logits [B, C], cross-entropy [B] against the rows' `labels` (mixed images:
  against `labels` and `mix_labels`, weighed 1 - `mix` and `mix`), and row weights
  [B] (a row of padding only, segment ids all 0, counts for nothing; an image's `weights`)."""
  if "images" in batch:
    logits_BC = model.classify(batch["images"])
    weights_B = batch["weights"].astype(jnp.float32)
  else:
    logits_BC = model.classify(batch["tokens"], attention_mask=batch["segment_ids"])
    weights_B = (batch["segment_ids"] != 0).any(axis=1).astype(jnp.float32)
  ce_B = optax.softmax_cross_entropy_with_integer_labels(
    logits_BC.astype(jnp.float32), batch["labels"]
  )
  if "mix" in batch:  # mixed training images (common/data/images.py mix_batch): both labels
    mix_ce_B = optax.softmax_cross_entropy_with_integer_labels(
      logits_BC.astype(jnp.float32), batch["mix_labels"]
    )
    ce_B = (1 - batch["mix"]) * ce_B + batch["mix"] * mix_ce_B
  return logits_BC, ce_B, weights_B


def classify_sums(model, batch: dict) -> tuple[jax.Array, jax.Array]:
  """Summed cross-entropy of a classifier over its rows, and the number of rows."""
  _, ce_B, weights_B = classify_rows(model, batch)
  return jnp.sum(ce_B * weights_B), jnp.sum(weights_B)


def contrastive_sums(model, batch: dict) -> tuple[jax.Array, jax.Array]:
  """CLIP's loss summed over this device's image-caption pairs, each scored against every pair
  of the global batch (common/tasks/contrastive_loss.py), and the number of pairs."""
  return contrastive_loss.contrastive_sums(
    model.encode_image(batch["images"]),
    model.encode_text(batch["text"]),
    logit_scale=model.logit_scale_value(),
    weights_B=batch["weights"],
  )


def zero_shot_logits(model, images_BHWC: jax.Array, prompts_CT: jax.Array) -> jax.Array:
  """Class logits [B, C] of a CLIP model with no classifier: each image's cosine similarity to
  each class's prompt (one text per class), times the logit scale."""

  def unit(x):
    return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), 1e-12)

  image_BP = unit(model.encode_image(images_BHWC).astype(jnp.float32))
  text_CP = unit(model.encode_text(prompts_CT).astype(jnp.float32))
  return model.logit_scale_value() * jnp.dot(image_BP, text_CP.T)


def shift_right(targets_BT: jax.Array, segment_ids_BT: jax.Array, start_id: int) -> jax.Array:
  """A decoder's inputs for `targets_BT` (teacher forcing): each target segment's tokens one
  place later, after `start_id` (T5's `_shift_right`, per segment when rows are packed)."""
  prev_BT = jnp.pad(targets_BT[:, :-1], ((0, 0), (1, 0)))
  prev_seg_BT = jnp.pad(segment_ids_BT[:, :-1], ((0, 0), (1, 0)))
  first_BT = segment_ids_BT != prev_seg_BT
  return jnp.where(first_BT, jnp.asarray(start_id, targets_BT.dtype), prev_BT)


def seq2seq_sums(model, batch: dict, *, loss_chunk: int = 0) -> tuple[jax.Array, jax.Array]:
  """Summed cross-entropy of an encoder-decoder over the real target tokens of a batch of
  {"inputs", "input_segment_ids", "targets", "target_segment_ids"} (segment 0: padding), the
  decoder reading the targets shifted right after its start token; and the number of targets."""
  if not isinstance(model, EncoderDecoder):
    raise UserError(
      f"Sequence-to-sequence data (inputs and targets) needs an encoder-decoder model such as "
      f"T5, not {type(model).__name__}: set model to a t5 config."
    )
  targets_BT, target_seg_BT = batch["targets"], batch["target_segment_ids"]
  decoder_BT = shift_right(targets_BT, target_seg_BT, model.decoder_start_id)
  weights_BT = (target_seg_BT != 0).astype(jnp.float32)
  x_BTD = model.hidden(
    batch["inputs"],
    decoder_BT,
    segment_ids_BS=batch["input_segment_ids"],
    decoder_segment_ids_BT=target_seg_BT,
  )
  if loss_chunk:  # train.loss_chunk, as for a decoder: the head a chunk of tokens at a time
    B, T, D = x_BTD.shape
    head, project = model.output_head()
    total = head_cross_entropy_sum(
      head,
      project,
      x_BTD.reshape(B * T, D),
      targets_BT.reshape(-1),
      weights_BT.reshape(-1),
      chunk=min(loss_chunk, B * T),
    )
    return total, jnp.sum(weights_BT)
  ce_BT = parallel.cross_entropy(model.logits(x_BTD), targets_BT)
  return jnp.sum(ce_BT * weights_BT), jnp.sum(weights_BT)


# Distillation (the distill task): divergences between a student's and a teacher's next-token
# distributions, over the vocabulary (split over `tensor` where the head is) or over a teacher's
# top-k ids.

DIVERGENCES = ("forward_kl", "reverse_kl", "jsd")


def log_softmax_vocab(logits_BTV: jax.Array) -> jax.Array:
  """log_softmax over the vocabulary in float32; with the vocab split over `tensor`, of this
  device's slice, normalised over the whole vocabulary (as `parallel.cross_entropy`)."""
  logits = logits_BTV.astype(jnp.float32)
  if not parallel.tensor_split("V"):
    return jax.nn.log_softmax(logits, axis=-1)
  m = jax.lax.stop_gradient(parallel.pmax_tensor(jnp.max(jax.lax.stop_gradient(logits), -1)))
  lse = jnp.log(parallel.psum_tensor(jnp.sum(jnp.exp(logits - m[..., None]), -1))) + m
  return logits - lse[..., None]


def sum_vocab(x_BTV: jax.Array) -> jax.Array:
  """Sum over the vocabulary (this device's slice and, split over `tensor`, the others')."""
  total = jnp.sum(x_BTV, axis=-1)
  return parallel.psum_tensor(total) if parallel.tensor_split("V") else total


def gather_vocab(logits_BTV: jax.Array, ids_BTK: jax.Array) -> jax.Array:
  """The logits [B, T, K] at the vocabulary ids `ids_BTK` (from the device holding each id's
  slice where the vocab is split over `tensor`)."""
  logits = logits_BTV.astype(jnp.float32)
  if not parallel.tensor_split("V"):
    return jnp.take_along_axis(logits, ids_BTK, axis=-1)
  v_local = logits.shape[-1]
  local = ids_BTK - parallel.tensor_index() * v_local
  here = (local >= 0) & (local < v_local)
  picked = jnp.take_along_axis(logits, jnp.clip(local, 0, v_local - 1), axis=-1)
  return parallel.psum_tensor(jnp.where(here, picked, 0.0))


def divergence(
  student_logp: jax.Array, teacher_logp: jax.Array, *, kind: str, beta: float = 0.5, total=None
) -> jax.Array:
  """Per-position divergence [B, T] between two distributions given as log-probabilities over
  the last axis, summed by `total` (`sum_vocab` over a split vocabulary; a plain sum by
  default). TRL GKDTrainer's `generalized_jsd_loss` conventions (Agarwal et al. 2024, eq. 1):

    forward_kl  KL(teacher || student) = sum_v t (log t - log s)
    reverse_kl  KL(student || teacher) = sum_v s (log s - log t)
    jsd         beta KL(t || m) + (1 - beta) KL(s || m),  m = beta t + (1 - beta) s;
                beta 0 is forward_kl and beta 1 reverse_kl (taken as those, as TRL does: the
                mixture's limit at 0 is 0, not the forward KL), 0.5 the Jensen-Shannon divergence.
  """
  total = total or (lambda x: jnp.sum(x, axis=-1))
  s, t = student_logp, teacher_logp
  if kind == "jsd" and beta == 0.0:
    kind = "forward_kl"
  if kind == "jsd" and beta == 1.0:
    kind = "reverse_kl"
  if kind == "forward_kl":
    return total(jnp.exp(t) * (t - s))
  if kind == "reverse_kl":
    return total(jnp.exp(s) * (s - t))
  if kind != "jsd":
    raise UserError(f"Unknown distill.loss {kind!r}: use one of {', '.join(DIVERGENCES)}.")
  m = jnp.logaddexp(t + np.log(beta), s + np.log1p(-beta))
  return total(beta * jnp.exp(t) * (t - m) + (1 - beta) * jnp.exp(s) * (s - m))
