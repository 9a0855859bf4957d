"""The grpo task: Group Relative Policy Optimization (DeepSeekMath, Shao et al., 2024, arXiv
2402.03300), online, with rewards a program checks (`data.format="prompts"`, `grpo.reward`).

Each train step, before the gradient (`complete`): every prompt of the batch is continued
`group_size` times by the zoo's compiled KV-cache sampler (`engine.continue_rows`) on the
current weights, each completion cut after the chat template's end of turn (or the end token);
the reward functions score them (common/tasks/rewards.py), and each completion's advantage is its
total reward (the weighted sum of the functions') against its group's:

    A_i = (r_i - mean(r_group)) / (std(r_group) + 1e-4)

Then the step minimises, over the completion's tokens o_i,t (the prompt is context only),

    ratio_i,t = pi(o_i,t) / pi_old(o_i,t)
    loss_i,t  = -min(ratio * A_i, clip(ratio, 1 - epsilon, 1 + epsilon) * A_i) + beta * KL_i,t
    KL_i,t    = exp(ref - logp) - (ref - logp) - 1      (the k3 estimator, >= 0)

with log-probabilities of the completion's tokens under logits / temperature, `ref` the
reference model's (`beta` > 0: the init_from weights; under LoRA the base, the adapters at zero,
no copy, as the dpo task does), and the mean taken as `loss_type` says: "dapo" (every completion
token of the batch counts once: sum / tokens), "grpo" (DeepSeekMath: each completion's mean, then
the mean over completions) or "dr_grpo" (sum / (completions x max_new_tokens)).

TRL's GRPOTrainer defaults, followed here: loss_type "dapo" (its default in recent releases, from
memory of its docs: check yours; "grpo" is the paper's), scale_rewards "group" (the std of
the group, unbiased; "batch": of the whole batch; "none": no division, Dr. GRPO), beta 0 (no
reference), epsilon 0.2, temperature 1, no top-k or top-p, num_iterations 1: the policy that
sampled is the one being trained, so pi_old is the current policy detached and the ratio is
exactly 1 (its gradient is A * grad log pi); the clipped form is kept, and a batch that carries
`old_logps` (several updates on one rollout, not done yet) is clipped against them. The KL and
the share of clipped tokens are measured in the step and logged (`kl`, `clip_ratio`).

Where this differs from TRL:
- group_size 4 (TRL's num_generations 8) and max_new_tokens 64 (TRL 256): sized for a CPU.
- truncated "mask" (a completion that uses all max_new_tokens without ending its turn takes no
  part in the loss, DAPO's overlong filtering; TRL's mask_truncated_completions is False): "keep"
  is TRL's default, "penalize" replaces its reward by `truncated_reward` instead.
- A reward that raises, returns the wrong number of values or a non-finite one stops the run
  (TRL takes None as "no reward" and NaN-sums).
- The data loader draws each prompt's sampling seed (common/data/pipeline.py `rollout_seed`, fixed
  by the run's seed and the prompt's place in the stream, saved with the iterator), and completion
  g of a prompt samples token t with fold_in(fold_in(key(seed), g), t): a resumed run draws the
  same rollouts, bit for bit, and no completion depends on the rows beside it or the mesh.
- A step's rows are as long as its longest prompt, padded to the sampler's bucket
  (`engine.bucket` from PROMPT_BUCKET tokens: 64, 96, 128, 192, ...; data.seq_len only caps
  it), plus max_new_tokens: short prompts do not pay for data.seq_len (SmolLM2 at seq_len=256 on
  40-token prompts computes rows of 96 tokens, not 288). The sampler and the step compile once
  per bucket a run meets; `batch_shapes` (what `zoo plan` and the memory check compile) is the
  largest, data.seq_len + max_new_tokens. The sampler's loop (sampling's one loop) ends when
  every row has written a one-token end of turn, else with the longest prompt's
  max_new_tokens. A row's tokens do not depend on its padding: the same rollouts, the same
  loss, at any bucket.
- TRL's `reward_std` is the mean of the groups' stds; here it is the std over the step's
  completions (`tied_groups`: the share of groups whose rewards all tie, TRL's
  frac_reward_zero_std).

Held out (`zoo eval`, train.eval_every): each prompt's greedy completion (temperature 0), its
mean `reward` (the weighted sum), each function's, the completion length and the share
truncated; `loss` is the negative mean reward.
"""

import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from nnx_zoo.common import engine, models, parallel, tasks
from nnx_zoo.common.errors import UserError
from nnx_zoo.common.nn import aux
from nnx_zoo.common.tasks import losses, reference
from nnx_zoo.common.tasks import rewards as rewards_lib

LOSS_TYPES = ("dapo", "grpo", "dr_grpo")
SCALES = ("group", "batch", "none")
TRUNCATED = ("mask", "penalize", "keep")


def config(**kw) -> ml_collections.ConfigDict:
  """The `grpo` section (see the module docstring)."""
  cfg = {
    "group_size": 4,  # completions sampled per prompt (TRL's num_generations)
    "beta": 0.0,  # the KL penalty to the reference; 0: no reference model
    "epsilon": 0.2,  # the ratio's clip
    "loss_type": "dapo",
    "scale_rewards": "group",
    "temperature": 1.0,
    "top_k": 0,
    "top_p": 1.0,
    "max_new_tokens": 64,
    # Comma-separated FILE.py:NAME or module:NAME, each optionally @WEIGHT.
    "reward": "",
    # A completion that hits max_new_tokens before its end of turn: "mask" (out of the loss),
    # "penalize" (its reward is truncated_reward) or "keep".
    "truncated": "mask",
    "truncated_reward": -1.0,
  }
  unknown = set(kw) - set(cfg)
  if unknown:
    raise UserError(f"Unknown grpo keys {sorted(unknown)}; known: {sorted(cfg)}.")
  cfg.update(kw)
  return ml_collections.ConfigDict(cfg)


def token_logps(model, batch: dict, temperature: float = 1.0) -> jax.Array:
  """[R, L - 1] log-probability of each next token of the rows (under logits / temperature)."""
  rows = losses.next_token_rows(batch)
  logits = model(rows["inputs"], positions_BT=rows["positions"], segment_ids_BT=rows["segment_ids"])
  return -parallel.cross_entropy(logits.astype(jnp.float32) / temperature, rows["targets"])


def advantages(rewards_R: np.ndarray, group_size: int, scale: str = "group") -> np.ndarray:
  """Each completion's reward against its group's mean (the rows of a group side by side), over
  the group's (or the batch's) unbiased standard deviation + 1e-4, or not scaled."""
  grouped = rewards_R.reshape(-1, group_size)
  centred = (grouped - grouped.mean(axis=1, keepdims=True)).reshape(-1)
  if scale == "group":
    std = np.repeat(grouped.std(axis=1, ddof=1) if group_size > 1 else 0.0, group_size)
    return centred / (std + 1e-4)
  if scale == "batch":
    return centred / (rewards_R.std(ddof=1) + 1e-4)
  return centred


def end_of(new: np.ndarray, stops: list[np.ndarray]) -> tuple[int, int] | None:
  """(start, end) of the first stop sequence in `new` (tokens), or None."""
  best = None
  for stop in stops:
    k = len(stop)
    if k == 0 or k > len(new):
      continue
    windows = np.lib.stride_tricks.sliding_window_view(new, k)
    hits = np.flatnonzero(np.all(windows == stop, axis=1))
    if len(hits) and (best is None or hits[0] < best[0]):
      best = (int(hits[0]), int(hits[0]) + k)
  return best


def rows_width(longest: int, seq_len: int) -> int:
  """The prompt part of a step's rows: its longest prompt in the sampler's bucket, at most
  data.seq_len (the prompts' own rows)."""
  return min(engine.bucket(max(longest, 1), minimum=engine.PROMPT_BUCKET), seq_len)


class GRPO(tasks.Task):
  name = "grpo"

  def __init__(self, settings=None, rewards=()):
    self.s = settings
    self.rewards = list(rewards)
    if settings is not None:
      self.rows_per_example = settings.group_size
    self._metrics: dict[str, list[float]] = {}

  # The step

  def loss_sums(self, model, batch, *, loss_chunk=0):
    if loss_chunk:
      raise UserError("The grpo task sums each completion's tokens: set train.loss_chunk=0.")
    s = self.s
    rows = losses.next_token_rows(batch)
    w = rows["weights"]  # [R, L - 1]: the completion's tokens as targets
    logp = token_logps(model, batch, s.temperature)
    old = batch["old_logps"] if "old_logps" in batch else jax.lax.stop_gradient(logp)
    ratio = jnp.exp(logp - old)
    a = batch["advantages"][:, None]
    clipped = jnp.clip(ratio, 1 - s.epsilon, 1 + s.epsilon)
    per_token = -jnp.minimum(ratio * a, clipped * a)
    tokens = jnp.maximum(jnp.sum(w), 1.0)
    if s.beta:
      d = batch["reference"] - logp
      kl = jnp.exp(d) - d - 1
      per_token = per_token + s.beta * kl
      aux.add("kl", jax.lax.stop_gradient(jnp.sum(kl * w) / tokens), weight=0.0)
    # Where the clip is the smaller term (A > 0 above 1 + epsilon, A < 0 below 1 - epsilon): no
    # gradient flows from that token's ratio (TRL's clip_ratio).
    clipped_tokens = ratio * a > clipped * a
    aux.add("clip_ratio", jax.lax.stop_gradient(jnp.sum(clipped_tokens * w) / tokens), weight=0.0)
    if s.loss_type == "grpo":  # each completion's mean, then the mean over completions
      length = jnp.sum(w, axis=1)
      total = jnp.sum(jnp.sum(per_token * w, axis=1) / jnp.maximum(length, 1.0))
      return total, jnp.sum((length > 0).astype(jnp.float32))
    total = jnp.sum(per_token * w)
    if s.loss_type == "dr_grpo":  # a constant denominator: completions x max_new_tokens
      return total, jnp.asarray(w.shape[0] * s.max_new_tokens, jnp.float32)
    return total, jnp.sum(w)  # dapo

  def eval_sums(self, model, batch, *, prompts=None):
    valid = batch["valid"]
    out = {
      "total": -jnp.sum(batch["reward"] * valid),
      "count": jnp.sum(valid),
      "reward": jnp.sum(batch["reward"] * valid),
      "length": jnp.sum(batch["length"] * valid),
      "truncated": jnp.sum(batch["truncated"] * valid),
    }
    for f, r in enumerate(self.rewards):
      out[f"reward/{r.name}"] = jnp.sum(batch["rewards"][:, f] * valid)
    return out

  def summary(self, sums):
    n = max(sums["count"], 1.0)
    out = {"loss": -sums["reward"] / n, "reward": sums["reward"] / n}
    out.update({k: v / n for k, v in sums.items() if k.startswith("reward/")})
    out.update(completion_length=sums["length"] / n, truncated=sums["truncated"] / n)
    return {**out, "prompts": int(n)}

  def batch_shapes(self, cfg):
    # The largest rows (prompts as long as data.seq_len); a step's own are often shorter.
    s = cfg.grpo
    R, L = cfg.train.batch_size * s.group_size, cfg.data.seq_len + s.max_new_tokens
    shapes = tasks.token_rows(R, L)
    shapes.update(loss_weights=((R, L), np.float32), advantages=((R,), np.float32))
    if s.beta:
      shapes["reference"] = ((R, L - 1), np.float32)
    return shapes

  # Set-up

  def configure(self, cfg) -> "GRPO":
    if "grpo" not in cfg:
      raise UserError(
        "The grpo task reads cfg.grpo: add `c.grpo = grpo.config(reward=...)` "
        "(nnx_zoo.common.tasks.grpo)."
      )
    if cfg.data.format != "prompts":
      raise UserError(
        "The grpo task samples completions of prompts: set --config.data.format=prompts (it is "
        f"{cfg.data.format!r})."
      )
    s = cfg.grpo
    for key, known in (("loss_type", LOSS_TYPES), ("scale_rewards", SCALES),
                       ("truncated", TRUNCATED)):  # fmt: skip
      if s[key] not in known:
        raise UserError(f"Unknown grpo.{key} {s[key]!r}: use one of {', '.join(known)}.")
    if s.group_size < 2:
      raise UserError(
        f"grpo.group_size={s.group_size}: a group needs 2 completions or more, its advantages "
        "being relative to each other."
      )
    if s.max_new_tokens < 1:
      raise UserError(f"grpo.max_new_tokens={s.max_new_tokens}: sample 1 token or more.")
    return GRPO(s, rewards_lib.load(s.reward))

  def prepare(self, data, *, cfg, layout=None) -> "GRPO":
    """The sampler compiled for the run's shapes, the records whose fields reach the rewards,
    the stop tokens, and the reference model (beta > 0)."""
    from nnx_zoo.common.data import chat, tokenizers

    s = self.s
    self._tokenizer = tokenizers.load(cfg.data.tokenizer)
    template = chat.template(cfg.data)
    self._stops = []
    if template.end_of_turn:
      self._stops.append(self._tokenizer.encode_chat(template.end_of_turn)[0])
    if self._tokenizer.eos_id is not None:
      self._stops.append(np.asarray([self._tokenizer.eos_id]))
    self._layout = layout
    # Each split's records (their fields reach the rewards by the index each row carries): the
    # held-out split's from `data`; the training split's, which the data kind hands the trainer
    # as an iterator only, read again on the first training step.
    self._splits = {} if data.eval is None else {"eval": data.eval}
    self._data_cfg = cfg.data
    graphdef = nnx.graphdef(models.abstract(cfg.model))
    # The sampler ends early once every row has written a one-token stop (HF templates' end of
    # turn, the end token): the rest of the rows is cut away here anyway.
    single = tuple(sorted({int(stop[0]) for stop in self._stops if len(stop) == 1}))
    self._sampling = dict(graphdef=graphdef, max_new_tokens=s.max_new_tokens, stop_ids=single)
    self._reference = None
    if s.beta:
      if not cfg.init_from:
        raise UserError(
          "grpo.beta > 0 keeps the policy near a reference model, the weights it starts from: "
          "set --config.init_from (or grpo.beta=0, no reference)."
        )
      self._reference = reference.Reference(cfg, layout)
      temperature = float(s.temperature)
      self._ref_logps = jax.jit(lambda p, b: token_logps(nnx.merge(graphdef, p), b, temperature))
    self._since = None
    return self

  def _split(self, split: str):
    """(records, prefill) of a split: its records, and the tokens every prompt of it has (run as
    one prefill)."""
    from nnx_zoo.common.data import pipeline

    if split not in self._splits:
      self._splits[split] = pipeline.load_split(self._data_cfg, split, self._tokenizer)
    rows = self._splits[split]
    return rows.records, max(int(rows.packed["segment_ids"].sum(axis=1).min()), 1)

  def _rollouts(self, params, prompts_RP, lengths_R, keys_R, *, split: str):
    """[R, P + N]: each row's prompt and its completion, sampled (training) or greedy (the
    sampler's one loop, through `engine.continue_rows`)."""
    s = self.s
    _, prefill = self._split(split)
    if split == "train":
      options = dict(temperature=float(s.temperature), top_k=int(s.top_k), top_p=float(s.top_p))
    else:
      options = dict(temperature=0.0)
    out = engine.continue_rows(
      params, prompts_RP, lengths_R, keys_R, prefill=prefill, **self._sampling, **options
    )
    return np.asarray(jax.device_get(out))

  # Before each step: the rollouts

  def complete(self, batch, params):
    if not hasattr(self, "_sampling"):
      raise RuntimeError("GRPO.complete before prepare: the trainer prepares the task first.")
    start = time.perf_counter()
    jax.block_until_ready(params)  # the previous step's update: training time, not sampling
    ready = time.perf_counter()
    training, lengths_R, out = self._rollout(batch, params)
    sampled = time.perf_counter()
    G = self.s.group_size if training else 1
    index_R = np.repeat(np.asarray(jax.device_get(batch["index"])), G)
    rows, scored, _ = self._score(out, lengths_R, index_R, lengths_R > 0, training)
    rewarded = time.perf_counter()
    if not training:
      return {**batch, **self._place(scored)}
    rows["advantages"] = advantages(scored["reward"], G, self.s.scale_rewards).astype(np.float32)
    rows = self._place(rows)
    if self.s.beta:
      rows["reference"] = self._ref_logps(self._reference.params(params), rows)
    self._log(scored, train_s=ready - (self._since or start), sample_s=sampled - ready,
              reward_s=rewarded - sampled)  # fmt: skip
    self._since = time.perf_counter()
    return rows

  def _rollout(self, batch, params):
    """(training, lengths_R, out [R, P + N]): a training batch's prompts (it carries their
    rollouts' seeds) each continued group_size times, sampled; a held-out batch's once, greedy.
    A held-out batch's padding rows have length 0."""
    training = "seed" in batch
    host = {k: np.asarray(jax.device_get(batch[k])) for k in ("tokens", "segment_ids")}
    lengths = host["segment_ids"].sum(axis=1).astype(np.int32)
    P = rows_width(int(lengths.max()), host["tokens"].shape[1])
    G = self.s.group_size if training else 1
    prompts_RP, lengths_R = np.repeat(host["tokens"][:, :P], G, axis=0), np.repeat(lengths, G)
    if training:
      seeds = np.asarray(jax.device_get(batch["seed"]))
      keys = jax.vmap(jax.random.key)(jnp.asarray(np.repeat(seeds, G), jnp.uint32))
      keys = jax.vmap(jax.random.fold_in)(keys, jnp.tile(jnp.arange(G), len(seeds)))
    else:  # greedy: the keys are not read
      keys = jax.vmap(jax.random.key)(jnp.zeros(len(lengths_R), jnp.uint32))
    split = "train" if training else "eval"
    return training, lengths_R, self._rollouts(params, prompts_RP, lengths_R, keys, split=split)

  def samples(self, data, *, cfg, split: str, count: int) -> list[dict]:
    """The first `count` prompts of `split` with their completions, as the run's first step
    samples them (train: group_size each, at the run's temperature) or its evaluation does
    (eval: one, greedy), from the weights the run starts from (init_from's; fresh ones without),
    each scored: [{"prompt": messages, "completions": [{"text", "reward", "rewards": {name:
    value}, "tokens", "truncated"}]}]."""
    from nnx_zoo.common.hub import weights

    self.prepare(data, cfg=cfg)
    if cfg.init_from:
      _, params = weights.init_from_params(cfg)
    else:
      params = nnx.state(models.build(cfg.model, seed=cfg.seed), nnx.Param)
    if split == "train":
      batch = next(iter(data.iterator))
    else:
      if data.eval is None:
        raise UserError("This experiment has no held-out prompts: set data.eval_files.")
      batch = next(iter(data.eval_batches(data.eval, batch_size=cfg.train.batch_size)))
    batch = {k: np.asarray(v)[:count] for k, v in batch.items()}
    training, lengths_R, out = self._rollout(batch, params)
    G = self.s.group_size if training else 1
    index_R = np.repeat(batch["index"], G)
    valid = lengths_R > 0
    _, scored, texts = self._score(out, lengths_R, index_R, valid, training)
    records, _ = self._split("train" if training else "eval")
    shown = []
    for r in np.flatnonzero(valid):
      if r % G == 0:
        shown.append({"prompt": records[index_R[r]]["prompt"], "completions": []})
      shown[-1]["completions"].append(
        {
          "text": texts[r],
          "reward": float(scored["reward"][r]),
          "rewards": {f.name: float(scored["rewards"][r, i]) for i, f in enumerate(self.rewards)},
          "tokens": int(scored["length"][r]),
          "truncated": bool(scored["truncated"][r]),
        }
      )
    return shown

  def _score(self, out, lengths_R, index_R, valid, training: bool):
    """The completions of `out` [R, P + N] (each row's prompt then its tokens) cut at their end of
    turn, scored: the training rows (tokens, segment_ids, loss_weights), {reward [R] (the
    weighted total), rewards [R, F], length, truncated, valid}, and each row's completion text
    ("" for a row that is not valid)."""
    split = "train" if training else "eval"
    s, (R, L) = self.s, out.shape
    N = s.max_new_tokens
    records, _ = self._split(split)
    kept = np.zeros(R, np.int32)
    truncated = np.zeros(R, bool)
    prompts, completions, fields = [], [], {}
    texts = [""] * R
    live = np.flatnonzero(valid)
    for r in live:
      new = out[r, lengths_R[r] : lengths_R[r] + N]
      stop = end_of(new, self._stops)
      content, kept[r] = (new, N) if stop is None else (new[: stop[0]], stop[1])
      truncated[r] = stop is None
      record = records[index_R[r]]
      prompts.append(record["prompt"])
      texts[r] = self._tokenizer.decode(content)
      completions.append([{"role": "assistant", "content": texts[r]}])
      for k, v in record.items():
        if k != "prompt":
          fields.setdefault(k, []).append(v)
    if any(len(v) != len(live) for v in fields.values()):
      raise UserError(
        f"The {split} prompt records do not all have the same fields ({', '.join(fields)}): "
        "the rewards take each field as one list, a value a completion."
      )
    per_fn = np.zeros((R, len(self.rewards)))
    per_fn[live] = rewards_lib.score(self.rewards, prompts, completions, fields).T
    reward = per_fn @ np.asarray([r.weight for r in self.rewards])
    if s.truncated == "penalize":
      reward = np.where(truncated, s.truncated_reward, reward)
    t = np.arange(L)[None]
    end = (lengths_R + kept)[:, None]
    segment_ids = ((t < end) & valid[:, None]).astype(np.int32)
    loss_weights = ((t >= lengths_R[:, None]) & (t < end)).astype(np.float32)
    if s.truncated == "mask":
      loss_weights = loss_weights * ~truncated[:, None]
    rows = {
      "tokens": np.where(segment_ids > 0, out, 0).astype(np.int32),
      "segment_ids": segment_ids,
      "loss_weights": loss_weights * valid[:, None],
    }
    scored = {
      "reward": reward.astype(np.float32),
      "rewards": per_fn.astype(np.float32),
      "length": kept.astype(np.float32),
      "truncated": truncated.astype(np.float32),
      "valid": valid.astype(np.float32),
    }
    return rows, scored, texts

  def _place(self, arrays: dict) -> dict:
    """Host arrays as the step takes them: split over the batch axes of the mesh."""
    if self._layout is None:
      return {k: jnp.asarray(v) for k, v in arrays.items()}
    sharding = parallel.NamedSharding(self._layout.mesh, self._layout.batch_spec)
    return {k: jax.device_put(v, sharding) for k, v in arrays.items()}

  # Logging

  def _log(self, scored, **times):
    m = {
      "reward": float(scored["reward"].mean()),
      "reward_std": float(scored["reward"].std()),
      # Groups whose rewards all tie: their advantages are 0, they teach nothing.
      "tied_groups": float(
        np.mean(np.ptp(scored["reward"].reshape(-1, self.s.group_size), 1) == 0)
      ),
      "completion_length": float(scored["length"].mean()),
      "truncated": float(scored["truncated"].mean()),
      # The completions' tokens (to each end of turn) a second of sampling.
      "sample_tokens_per_s": float(scored["length"].sum()) / max(times["sample_s"], 1e-9),
      **times,
    }
    for f, r in enumerate(self.rewards):
      m[f"reward/{r.name}"] = float(scored["rewards"][:, f].mean())
    for k, v in m.items():
      self._metrics.setdefault(k, []).append(v)

  def step_metrics(self) -> dict:
    """The means, over the steps since the last call, of what `complete` measured: the rewards
    (total, its std, each function's), the completion length, the share truncated, and the
    seconds of sampling, scoring and training (the update and data loading) a step."""
    out = {k: float(np.mean(v)) for k, v in self._metrics.items()}
    self._metrics = {}
    return out


tasks.register(GRPO())
