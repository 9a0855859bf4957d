"""The distill task: a student learns a frozen teacher's next-token distributions, on the data's
tokens and (on-policy, GKD: Agarwal et al. 2024, arXiv 2306.13649) on its own samples.

The teacher (`distill.teacher`) is any checkpoint `init_from` takes: a zoo run's workdir, a `zoo
convert` output, a Hugging Face directory or a .gguf file. It is frozen: its params reach the
step in the batch (`tasks.FROZEN`, added by `complete`), placed on the mesh by the same rules as
the student's params and split over it as they are; the step differentiates the student's only,
and the optimizer holds no state for the teacher. It runs in its own dtype (its checkpoint's
model config), inside the train step, beside the student's forward pass. With
`distill.teacher_quant` ("int8", "int4", "nf4") the kernels of its blocks' Linears are stored as
QLoRA stores a frozen base (common/nn/qlora.py: quantized as each is read, never a whole fp32
copy; dequantized inside the step to its dtype); its embeddings, head and norms stay as they are.

The student is `init_from`'s model (as chat/sft), or, with `distill.student_layers` ("every:2",
or a list "0,2,4"), a model of init_from's family made of those of its layers (DistilBERT and
Minitron start so): `zoo show` prints both.

Per token that the data weighs (chat: the assistant's), with the student's and the teacher's
log-probabilities at temperature T (log_softmax(logits / T)):

    loss = (1 - alpha) * T^2 * D(teacher, student) + alpha * CE(student, next token)

D is `distill.loss` (common/tasks/losses.py `divergence`, TRL GKDTrainer's conventions):
"forward_kl" KL(t || s), "reverse_kl" KL(s || t), or "jsd", the generalized Jensen-Shannon
divergence with `beta` (0: forward KL, 1: reverse KL, 0.5: JSD). T^2 keeps the gradient's scale
as T changes (Hinton et al. 2015; tunix's LogitStrategy). `alpha` mixes in the next-token loss
on the data's labels (tunix's `alpha` is the weight of the distillation term instead: its alpha
is 1 - ours); alpha 1 is SFT alone, with the teacher's KL still measured. TRL's GKDTrainer is
alpha 0, T 1 in the loss.

`teacher_kl` is D itself (at T, no T^2) over the weighted tokens: logged each training step, and
held out (train.eval_every, `zoo eval`) beside `next_token_loss` (the next-token cross-entropy on
the same tokens: the assistant's loss). `zoo eval` of a workdir with no checkpoint evaluates
init_from's student: its KL before training.

On-policy (`distill.lmbda`): that fraction of training batches (drawn by a hash of the batch and
the seed, so a resumed run draws the same) is replaced by the student's own replies: each row's
prompt (its tokens up to its first weighted target: the first assistant turn's start) is continued
by the zoo's compiled sampler (`engine.continue_rows`, as the grpo task samples) on the current
weights, at `sample_temperature`, for at most `max_new_tokens` within the row's length; the reply
is cut after its end of turn (or end token) and the tokens past it are masked as the grpo task
masks them (segment 0, weight 0). The teacher then scores every sampled token. lmbda 0 is the
data alone.

Teacher outputs written once (`zoo data prepare`, `after_prepare`): each token's top-k
(`distill.top_k`) teacher log-probabilities and ids beside the prepared tokens; a run on that
directory reads them instead of running the teacher, and D is then over the top-k ids with both
distributions renormalised over them (docs/distill.md says how that compares with the full D).
"""

import dataclasses
import functools
import json
import zlib

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from nnx_zoo.common import engine, models, parallel, tasks
from nnx_zoo.common.errors import UserError
from nnx_zoo.common.nn import aux, qlora
from nnx_zoo.common.tasks import losses


def config(**kw) -> ml_collections.ConfigDict:
  """The `distill` section (see the module docstring)."""
  cfg = {
    "teacher": "",  # the checkpoint to learn from (required)
    # The teacher's blocks' kernels stored as model.lora.base_quant stores a frozen base: "int8",
    # "int4" or "nf4" ("": in its own dtype).
    "teacher_quant": "",
    "student_layers": "",  # "": init_from's model; "every:K" or "0,2,4": those of its layers
    "loss": "forward_kl",  # or "reverse_kl", "jsd"
    "beta": 0.5,  # jsd's interpolation: 0 forward KL, 1 reverse KL
    "temperature": 1.0,
    "alpha": 0.0,  # the next-token loss's share: 0 distillation alone, 1 SFT alone
    "lmbda": 0.0,  # the share of training batches the student samples itself (GKD)
    "max_new_tokens": 64,  # on-policy: a reply's most tokens
    "sample_temperature": 1.0,  # on-policy: the student's sampling temperature
    "top_k": 16,  # `zoo data prepare`: the teacher's top-k log-probabilities per token
  }
  unknown = set(kw) - set(cfg)
  if unknown:
    raise UserError(f"Unknown distill keys {sorted(unknown)}; known: {sorted(cfg)}.")
  cfg.update(kw)
  return ml_collections.ConfigDict(cfg)


@dataclasses.dataclass(frozen=True)
class Teacher:
  """What start-up knows of the teacher: where it is, its model config (in its own dtype)."""

  path: str
  kind: str
  model: ml_collections.ConfigDict
  quant: str = ""  # distill.teacher_quant: its blocks' kernels stored quantized (qlora.store)

  def run_config(self, seed: int = 0) -> ml_collections.ConfigDict:
    """A config whose init_from is the teacher (what `weights.init_from_params` reads)."""
    return ml_collections.ConfigDict(
      {"model": self.model.to_dict(), "init_from": self.path, "seed": seed, "init_reinit": ""}
    )

  def abstract(self) -> nnx.Module:
    """The teacher's model with ShapeDtypeStructs for weights, its blocks' kernels as `quant`
    stores them."""
    if not self.quant:
      return models.abstract(self.model)
    return nnx.eval_shape(
      lambda: qlora.store(models.build(self.model), self.quant, key="distill.teacher_quant")
    )

  def params(self, seed: int = 0, layout=None) -> nnx.State:
    """The teacher's weights, placed on `layout`'s mesh as the train step places the student's;
    with `quant`, each block kernel quantized as it is read (`qlora.quantizer`, as a QLoRA base
    is loaded)."""
    from nnx_zoo.common.hub import weights

    cfg = self.run_config(seed)
    if not self.quant:
      return weights.init_from_params(cfg, layout)[1]
    params = nnx.state(self.abstract(), nnx.Param)
    cfg.model.lora.base_quant = self.quant  # what `init_params` quantizes as it reads
    loaded = weights.init_params(cfg, params)  # every weight is the checkpoint's: none is fresh
    return weights.with_init_from(loaded, params, parallel.placement(params, layout))


def vocabulary(tokenizer) -> list[str]:
  """Each id's token, in id order."""
  from nnx_zoo.common.data import tokenizers

  if isinstance(tokenizer, tokenizers.HFTokenizer):
    return [tokenizer.tok.id_to_token(i) for i in range(tokenizer.vocab_size)]
  return [tokenizer.token_text(i) for i in range(tokenizer.vocab_size)]


def check_tokenizers(teacher_cfg, student_cfg):
  """That the teacher's and the student's tokenizers give every id the same token: else one
  line naming both vocabulary sizes and the first id that differs."""
  from nnx_zoo.common.data import tokenizers

  if tokenizers.identity(teacher_cfg) == tokenizers.identity(student_cfg):
    return
  t, s = (vocabulary(tokenizers.load(c)) for c in (teacher_cfg, student_cfg))
  first = next((i for i, (a, b) in enumerate(zip(t, s, strict=False)) if a != b), None)
  if first is None and len(t) == len(s):
    return  # the same ids (the files differ elsewhere: a chat template, say)
  first = min(len(t), len(s)) if first is None else first
  token = lambda v: repr(v[first]) if first < len(v) else "none"  # noqa: E731
  raise UserError(
    f"The teacher's tokenizer ({len(t)} ids) and the student's ({len(s)} ids) differ, first at "
    f"id {first} ({token(t)} vs {token(s)}): distillation compares their distributions id by id, "
    "so give a teacher and a student that share a tokenizer."
  )


@functools.cache
def _teacher(path: str, student_tokenizer: str, student_vocab: int, quant: str) -> Teacher:
  """The teacher at `path`, checked against the student (its tokenizer as JSON, its vocab)."""
  import os

  from nnx_zoo.common.hub import weights

  local = weights.locate(path)
  if not os.path.exists(local):
    raise UserError(
      f"distill.teacher={path!r} does not exist: give a zoo run's workdir, a `zoo convert` "
      "output, a Hugging Face directory or a .gguf file."
    )
  src = weights.source(path)
  model = models.upgrade(src.model.to_dict())
  if src.tokenizer is None:
    raise UserError(
      f"distill.teacher={path!r} ({src.kind}) has no tokenizer, so its token ids cannot be "
      "checked against the student's: copy its tokenizer files into it."
    )
  check_tokenizers(src.tokenizer, ml_collections.ConfigDict(json.loads(student_tokenizer)))
  if model.vocab_size != student_vocab:
    raise UserError(
      f"The teacher's output covers {model.vocab_size} ids and the student's {student_vocab}: "
      "distillation compares them id by id, so give models with the same vocabulary size."
    )
  return Teacher(src.path, src.kind, model, quant)


def teacher_of(cfg) -> Teacher:
  s = cfg.distill
  if not s.teacher:
    raise UserError(
      "distill.teacher is empty: set --config.distill.teacher to the checkpoint the student "
      "learns from (a zoo run's workdir, a `zoo convert` output, a Hugging Face directory or a "
      ".gguf file)."
    )
  tokenizer = json.dumps(cfg.data.tokenizer.to_dict(), sort_keys=True)
  return _teacher(s.teacher, tokenizer, int(cfg.model.vocab_size), s.teacher_quant)


def check_settings(s, cfg):
  """The `distill` section's values, and the mesh it runs on."""
  fmt = cfg.data.get("format", "text")
  if fmt not in ("text", "chat"):
    raise UserError(
      f"The distill task learns the teacher's next-token distributions over rows of text or "
      f"chat: set --config.data.format=chat or text (it is {fmt!r})."
    )
  if s.teacher_quant not in qlora.KINDS:
    raise UserError(
      f"Unknown distill.teacher_quant {s.teacher_quant!r}: use one of "
      f"{', '.join(map(repr, qlora.KINDS))} ('': the teacher in its own dtype)."
    )
  if s.loss not in losses.DIVERGENCES:
    raise UserError(f"Unknown distill.loss {s.loss!r}: use one of {', '.join(losses.DIVERGENCES)}.")
  for key in ("beta", "alpha", "lmbda"):
    if not 0.0 <= float(s[key]) <= 1.0:
      raise UserError(f"distill.{key}={s[key]} is outside [0, 1]: give a value in [0, 1].")
  for key in ("temperature", "sample_temperature"):
    if not float(s[key]) > 0:
      raise UserError(f"distill.{key}={s[key]}: give a temperature above 0.")
  if s.top_k < 0:
    raise UserError(f"distill.top_k={s.top_k}: give 1 or more (0: write no teacher outputs).")
  if s.lmbda and fmt != "chat":
    raise UserError(
      f"distill.lmbda={s.lmbda}: the student samples replies to the prompts of chat data; this "
      "data is text: set data.format=chat, or distill.lmbda=0."
    )
  if s.lmbda and not 0 < s.max_new_tokens < cfg.data.seq_len:
    raise UserError(
      f"distill.max_new_tokens={s.max_new_tokens}: on-policy replies take 1 or more of a row's "
      f"data.seq_len={cfg.data.seq_len} tokens, and leave some to the prompt."
    )
  for axis in ("context", "pipeline"):
    if int(cfg.get("mesh", {}).get(axis, 1)) > 1:
      raise UserError(
        f"mesh.{axis} > 1: the distill task runs its teacher on the data, fsdp, expert and "
        f"tensor axes only: set mesh.{axis}=1."
      )


class Distill(tasks.Task):
  name = "distill"
  decoder = True

  def __init__(self, settings=None, teacher: Teacher | None = None):
    self.s = settings
    self.teacher = teacher
    self._metrics: dict[str, list[float]] = {}

  # The step

  @functools.cached_property
  def _teacher_graphdef(self):
    return nnx.graphdef(self.teacher.abstract())

  def _terms(self, model, batch, loss_chunk: int = 0):
    """Per target [B, T]: the divergence D at the temperature, the next-token cross-entropy, and
    the targets' weights. `loss_chunk` (train.loss_chunk): the student's head, and the
    teacher's, run that many tokens at a time (`losses.decoder_token_map`): neither's [B, T, V]
    logits exist whole."""
    s = self.s
    T, kind, beta = float(s.temperature), s.loss, float(s.beta)
    rows = losses.next_token_rows(batch)
    inputs, targets = rows["inputs"], rows["targets"]
    pos, seg = rows["positions"], rows["segment_ids"]
    kw = dict(positions_BT=pos, segment_ids_BT=seg)

    def against_top_k(logits, ids, teacher_logps):  # prepared: both over the teacher's ids
      teacher = jax.nn.log_softmax(teacher_logps.astype(jnp.float32) / T, -1)
      student = jax.nn.log_softmax(losses.gather_vocab(logits, ids) / T, -1)
      return losses.divergence(student, teacher, kind=kind, beta=beta)

    def against_logits(logits, teacher_logits):
      teacher = losses.log_softmax_vocab(teacher_logits.astype(jnp.float32) / T)
      student = losses.log_softmax_vocab(logits.astype(jnp.float32) / T)
      return losses.divergence(student, teacher, kind=kind, beta=beta, total=losses.sum_vocab)

    prepared = "teacher_logps" in batch
    if prepared:
      teacher_xs = (batch["teacher_ids"][:, 1:].astype(jnp.int32), batch["teacher_logps"][:, 1:])
    else:
      frozen = nnx.merge(self._teacher_graphdef, batch[tasks.FROZEN])
    if not loss_chunk:
      logits = model(inputs, **kw)
      if prepared:
        d = against_top_k(logits, *teacher_xs)
      else:
        d = against_logits(logits, jax.lax.stop_gradient(frozen(inputs, **kw)))
      return d, parallel.cross_entropy(logits, targets), rows["weights"]

    if prepared:
      consts = None

      def per_token(logits, _, targets, *teacher):
        return against_top_k(logits, *teacher), parallel.cross_entropy(logits, targets)

    else:  # the teacher's hidden states whole, its head a chunk at a time beside the student's
      x, head, project = losses.hidden_and_head(frozen, inputs, seg, pos)
      teacher_xs = (jax.lax.stop_gradient(x),)
      head_graphdef, consts = nnx.split(head)

      def per_token(logits, head_state, targets, x):
        teacher_logits = project(nnx.merge(head_graphdef, head_state), x)
        d = against_logits(logits, jax.lax.stop_gradient(teacher_logits))
        return d, parallel.cross_entropy(logits, targets)

    d, ce = losses.decoder_token_map(
      model, inputs, seg, per_token, chunk=loss_chunk, positions_BT=pos,
      xs=(targets, *teacher_xs), consts=consts,
    )  # fmt: skip
    return d, ce, rows["weights"]

  def loss_sums(self, model, batch, *, loss_chunk=0):
    s = self.s
    d, ce, w = self._terms(model, batch, loss_chunk)
    T = float(s.temperature)
    per_token = (1.0 - s.alpha) * T * T * d + s.alpha * ce
    count = jnp.sum(w)
    kl = jax.lax.stop_gradient(jnp.sum(d * w) / jnp.maximum(count, 1.0))
    aux.add("teacher_kl", kl, weight=0.0)  # logged, not trained on (it is in the loss already)
    return jnp.sum(per_token * w), count

  def eval_sums(self, model, batch, *, prompts=None):
    s = self.s
    d, ce, w = self._terms(model, batch)
    T = float(s.temperature)
    return {
      "total": jnp.sum(((1.0 - s.alpha) * T * T * d + s.alpha * ce) * w),
      "count": jnp.sum(w),
      "teacher_kl": jnp.sum(d * w),
      "next_token": jnp.sum(ce * w),
    }

  def summary(self, sums):
    n = max(sums["count"], 1.0)
    ce = sums["next_token"] / n
    return {
      "loss": sums["total"] / n,
      "teacher_kl": sums["teacher_kl"] / n,
      "next_token_loss": ce,
      "perplexity": float(np.exp(min(ce, 50.0))),
      "targets": int(n),
    }

  def context_rows(self, batch):
    return None  # the teacher's rows are not split over mesh.context

  # Set-up

  def configure(self, cfg) -> "Distill":
    if "distill" not in cfg:
      raise UserError(
        "The distill task reads cfg.distill: add `c.distill = distill.config(teacher=...)` "
        "(nnx_zoo.common.tasks.distill)."
      )
    check_settings(cfg.distill, cfg)
    teacher = teacher_of(cfg)
    if teacher.quant:
      teacher.abstract()  # a kernel qlora cannot store is refused before anything is written
    return Distill(cfg.distill, teacher)

  def show(self, cfg) -> list[str]:
    from nnx_zoo.common.hub import weights

    t = self.teacher
    lines = [
      f"# teacher: {t.path} ({t.kind}): {t.model.family}, {t.model.num_layers} layers, "
      f"{models.num_params(t.model):,} parameters, {t.model.dtype}"
      + (f", its blocks' kernels stored {t.quant}" if t.quant else "")
      + ", frozen (no gradient, no optimizer state)"
    ]
    spec = weights.layer_spec(cfg)
    count = weights.source(cfg.init_from).model.num_layers if spec else 0
    made = (
      f"made of layers {list(weights.select_layers(spec, count))} of init_from's {count} "
      f"(distill.student_layers={spec})"
      if spec
      else "init_from's model"
    )
    lines.append(
      f"# student: {cfg.model.family}, {cfg.model.num_layers} layers, "
      f"{models.num_params(cfg.model):,} parameters: {made}"
    )
    return lines

  def prepare(self, data, *, cfg, layout=None) -> "Distill":
    """The teacher's params placed on the mesh as the student's are (unless every batch brings
    the teacher's prepared outputs), and the on-policy sampler's settings."""
    from nnx_zoo.common.data import prepared

    self._layout = layout
    self._seed = int(cfg.seed)
    self._teacher_params = None
    if not prepared.reads_teacher(cfg) or self.s.lmbda > 0:
      self._teacher_params = self.teacher.params(cfg.seed, layout)
    if self.s.lmbda > 0:
      from nnx_zoo.common.data import chat, tokenizers

      tokenizer = tokenizers.load(cfg.data.tokenizer)
      template = chat.template(cfg.data)
      self._stops = []
      if template.end_of_turn:
        self._stops.append(tokenizer.encode_chat(template.end_of_turn)[0])
      if tokenizer.eos_id is not None:
        self._stops.append(np.asarray([tokenizer.eos_id]))
      single = tuple(sorted({int(stop[0]) for stop in self._stops if len(stop) == 1}))
      self._sampling = dict(
        graphdef=nnx.graphdef(models.abstract(cfg.model)),
        max_new_tokens=int(self.s.max_new_tokens),
        temperature=float(self.s.sample_temperature),
        stop_ids=single,
      )
    return self

  # Before each step

  def complete(self, batch, params):
    """The batch with the teacher's params (`tasks.FROZEN`), unless it brings the teacher's
    prepared top-k outputs."""
    if "teacher_logps" in batch:
      return batch
    if getattr(self, "_teacher_params", None) is None:
      raise RuntimeError("Distill.complete before prepare: the trainer prepares the task first.")
    return {**batch, tasks.FROZEN: self._teacher_params}

  def complete_train(self, batch, params):
    """A training batch, or (a `lmbda` share of them, on-policy) the student's own replies to
    its rows' prompts, with the teacher's params."""
    if not self.s.lmbda:
      return self.complete(batch, params)
    from nnx_zoo.common.tasks import grpo

    # This process's rows (several processes: each samples its own, on a whole copy of the
    # weights, as the grpo task does); the draw is the global batch's, alike on every process.
    host = {k: grpo.local_rows(batch[k]) for k in ("tokens", "segment_ids")}
    weights = batch.get("loss_weights")
    host["loss_weights"] = (
      grpo.local_rows(weights) if weights is not None else host["segment_ids"] > 0
    )
    draw = on_policy_draw(grpo.gather(host["tokens"]), self._seed)
    on_policy = draw.random() < self.s.lmbda
    self._metrics.setdefault("on_policy", []).append(float(on_policy))
    if not on_policy:
      return self.complete(batch, params)
    sizes = grpo.gather(np.asarray([len(host["tokens"])]))
    first = int(sizes[: jax.process_index()].sum())  # this process's first row in the batch
    rows, kept = self._replies(
      host, grpo.whole_here(params), seed=int(draw.integers(2**31)), first_row=first
    )
    if jax.process_count() > 1:
      total, count = grpo.gather(np.asarray([[kept.sum(), len(kept)]], np.float64)).sum(0)
      self._metrics.setdefault("reply_length", []).append(float(total / max(count, 1)))
    else:
      self._metrics.setdefault("reply_length", []).append(float(kept.mean()))
    return self.complete(self._place(rows), params)

  def _replies(self, host, params, *, seed: int, first_row: int = 0):
    """Rows [B, L]: each row's prompt (its tokens before the first weighted target of its first
    segment) and the student's reply, cut after its end of turn; and each reply's length.
    Row b is the batch's row first_row + b (its key: fold_in(key(seed), first_row + b))."""
    from nnx_zoo.common.tasks import grpo

    tokens, segments, weights = host["tokens"], host["segment_ids"], host["loss_weights"]
    B, L = tokens.shape
    N = self._sampling["max_new_tokens"]
    P = L - N
    first = (segments == 1) & (weights > 0) & (np.arange(L) > 0)
    lengths = np.where(first.any(axis=1), first.argmax(axis=1), 0).astype(np.int32)
    valid = (lengths > 0) & (lengths <= P)
    lengths = np.where(valid, lengths, 1)  # a row with no prompt that fits: sampled, not trained
    prompts = np.where(np.arange(P) < lengths[:, None], tokens[:, :P], 0).astype(np.int32)
    rows_B = jnp.arange(first_row, first_row + B)
    keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(jax.random.key(seed), rows_B)
    out = engine.continue_rows(
      params, prompts, lengths, keys, prefill=int(lengths.min()), **self._sampling
    )
    out = np.asarray(jax.device_get(out))
    kept = np.zeros(B, np.int32)
    for r in range(B):
      stop = grpo.end_of(out[r, lengths[r] : lengths[r] + N], self._stops)
      kept[r] = N if stop is None else stop[1]
    t = np.arange(L)[None]
    end = (lengths + kept)[:, None]
    segment_ids = ((t < end) & valid[:, None]).astype(np.int32)
    loss_weights = ((t >= lengths[:, None]) & (t < end) & valid[:, None]).astype(np.float32)
    rows = {
      "tokens": np.where(segment_ids > 0, out, 0).astype(np.int32),
      "segment_ids": segment_ids,
      "loss_weights": loss_weights,
    }
    return rows, kept[valid] if valid.any() else np.zeros(1)

  def _place(self, arrays: dict) -> dict:
    """This process's host rows as the step takes them: split over the batch axes of the mesh
    (the grpo task's `place_rows`)."""
    from nnx_zoo.common.tasks import grpo

    return grpo.place_rows(arrays, self._layout)

  def step_metrics(self) -> dict:
    """On-policy runs: the share of batches sampled by the student, their mean reply length."""
    out = {k: float(np.mean(v)) for k, v in self._metrics.items()}
    self._metrics = {}
    return out

  # Teacher outputs written once

  def after_prepare(self, cfg, out, *, num_processes=1, process_id=0, progress=True) -> dict:
    """`zoo data prepare`: the teacher's top-k log-probabilities of every prepared token."""
    if not self.s.top_k:
      return {}
    from nnx_zoo.common.data import prepared

    teacher_cfg = self.teacher.run_config(cfg.seed)
    return prepared.write_teacher(
      out,
      row_len=cfg.data.seq_len + 1,
      top_k=int(self.s.top_k),
      teacher={"path": self.teacher.path, "model": self.teacher.model.to_dict()},
      logps=functools.partial(_teacher_top_k, teacher_cfg, int(self.s.top_k)),
      batch_size=int(cfg.train.batch_size),
      num_processes=num_processes,
      process_id=process_id,
      progress=progress,
    )


def on_policy_draw(tokens_BL: np.ndarray, seed: int) -> np.random.Generator:
  """The generator that decides whether a training batch is sampled on-policy, and its seed:
  from the batch's tokens and the run's seed, so a resumed run decides and samples the same."""
  return np.random.default_rng([seed, zlib.crc32(np.ascontiguousarray(tokens_BL).tobytes())])


@functools.cache
def _teacher_program(teacher_cfg_json: str, top_k: int):
  from nnx_zoo.common.hub import weights

  teacher_cfg = ml_collections.ConfigDict(json.loads(teacher_cfg_json))
  graphdef, params = weights.init_from_params(teacher_cfg)

  @jax.jit
  def top(params, batch):
    rows = losses.next_token_rows(batch)
    model = nnx.merge(graphdef, params)
    logits = model(
      rows["inputs"], positions_BT=rows["positions"], segment_ids_BT=rows["segment_ids"]
    )
    return jax.lax.top_k(jax.nn.log_softmax(logits.astype(jnp.float32), -1), top_k)

  return functools.partial(top, params)


def _teacher_top_k(teacher_cfg, top_k: int, batch: dict) -> tuple[np.ndarray, np.ndarray]:
  """The teacher's top-k log-probabilities and ids [R, L, k] of packed rows [R, L]: at index t
  of a row, of its token t given the row's tokens before it (index 0: zeros)."""
  program = _teacher_program(json.dumps(teacher_cfg.to_dict(), sort_keys=True), top_k)
  logps, ids = jax.device_get(program({k: jnp.asarray(v) for k, v in batch.items()}))
  pad = ((0, 0), (1, 0), (0, 0))
  return np.pad(np.asarray(logps), pad), np.pad(np.asarray(ids), pad)


tasks.register(Distill())
