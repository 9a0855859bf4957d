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
exactly 1 (its gradient is A * grad log pi). The KL and the share of clipped tokens are
measured in the step and logged (`kl`, `clip_ratio`).

The levers (TRL's names where TRL has them; each default keeps the step above, bit for bit):
- `num_iterations` (mu): each rollout trains `mu` updates, and a step is one update (TRL's
  count): steps 1..mu share rollout 1. pi_old is the trainer's own log-probs on the rollout's
  weights (`old_logps`, one forward pass as the rollout is made, as TRL takes them), so update 1's
  ratio is 1 and the later ones' are not. The rollout's rows ride in the prompts' stream
  (common/data/pipeline.py `PromptStream.hold`), whose state every checkpoint saves: a run
  stopped between the updates of one rollout resumes with that rollout, bit for bit (on as many
  processes: the rows are each process's own). The trainer's draws on updates 2..mu repeat the
  batch and take no prompts.
- `epsilon_high` (DAPO's clip-higher): clip(ratio, 1 - epsilon, 1 + epsilon_high); 0: epsilon.
- `importance_sampling_level` "sequence" (GSPO, arXiv 2507.18071): one ratio a completion,
  exp(mean over its tokens of log pi - log pi_old), clipped and weighted as a token's is.
- `filter_tied_groups` (DAPO's dynamic sampling; verl's filter_groups): a group whose rewards
  all tie (advantages 0) is dropped and the batch refilled with the groups of more prompts, drawn
  from the same stream (`PromptStream.more`: its state is the iterator's, so a resumed run draws
  the same), in at most `filter_max_rounds` rounds of sampling a step (the step's own batch the
  first). A batch still short trains on what it has, its other rows empty (no loss), and the
  line says so (`unfilled_groups`); `sampling_rounds` and `sampled_prompts` say what it cost.
  On several processes each fills its own share, and the processes agree on the rounds (one
  more while any is short): the batch then depends on the number of processes.
- `sampler_correction` (TRL's vllm_importance_sampling_correction, mode token_truncate or
  token_mask, cap `sampler_correction_cap`, 3 as TRL): the rollouts carry the sampler's
  log-prob q of each token (the engine's, SamplingParams(logprobs=0)); each token's loss is
  weighted by w = min(p / q, cap) ("token_truncate", truncated importance sampling) or by p / q
  and 0 above the cap ("token_mask"), p the trainer's log-probs on the rollout's weights. The
  mismatch is logged as KL(q || p) by k3 over the sampled tokens, `sampler_kl`, with the share
  of tokens above the cap, `sampler_capped`. Where the sampler differs from the trainer:
  `sampler_dtype` "bfloat16" samples with a bf16 copy of the weights computing in bf16 (a
  sampler dtype alone logs the mismatch without correcting it). The engine's log-probs are
  its logits' own, so the correction needs temperature 1 and no top-k or top-p.
- `soft_punish_cache` (DAPO's soft overlong punishment, beside `truncated`, its overlong
  filtering): a completion of |y| tokens past max_new_tokens - cache loses
  soft_punish_factor x (|y| - (max_new_tokens - cache)) / cache of reward (all of it at
  max_new_tokens), in training only (the held-out reward is the functions').

In full, with w_t the sampler correction's weight (1 without) and s_i the sequence ratio:

    ratio_i,t = exp(logp - old)              ("token")   or   s_i = exp(mean_t(logp - old))
    loss_i,t  = -min(ratio A_i, clip(ratio, 1 - epsilon, 1 + epsilon_high) A_i) w_t
                + beta KL_i,t

Several processes: each samples, scores and weighs its own prompts' groups (a group stays on
the process that holds its prompt's row), with a whole copy of the weights on its first device
(gathered from the mesh each rollout), and gives its rows to the step, which is the trainer's;
`scale_rewards="batch"` takes the std of every process's rewards, the rows widen to the widest
process's, and the logged rewards are every process's.

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

import math
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from nnx_zoo.common import engine, models, parallel, tasks
from nnx_zoo.common.errors import UserError
from nnx_zoo.common.nn import aux
from nnx_zoo.common.tasks import episodes, losses, reference
from nnx_zoo.common.tasks import rewards as rewards_lib
from nnx_zoo.common.tasks import tools as tools_lib

LOSS_TYPES = ("dapo", "grpo", "dr_grpo")
SCALES = ("group", "batch", "none")
TRUNCATED = ("mask", "penalize", "keep")
LEVELS = ("token", "sequence")
CORRECTIONS = ("none", "token_truncate", "token_mask")
SAMPLER_DTYPES = ("", "float32", "bfloat16", "float16")


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
    # The levers (TRL's names where TRL has them); each default keeps the plain GRPO step.
    "num_iterations": 1,  # updates on each rollout (TRL's mu); a step is one update
    "epsilon_high": 0.0,  # the ratio's upper clip (DAPO's clip-higher: 0.28); 0: epsilon
    "importance_sampling_level": "token",  # "sequence": GSPO's one ratio a completion
    # Dynamic sampling (DAPO; verl's filter_groups): groups whose rewards all tie are dropped
    # and the batch refilled with more prompts, in at most filter_max_rounds rounds a step.
    "filter_tied_groups": False,
    "filter_max_rounds": 4,
    # One process: a round's prompts take the slots of finished rows as soon as the rounds so
    # far cannot fill the batch, instead of after the round's longest row (the same rows).
    "refill": True,
    # The sampler's weights: "" the params as they are, "bfloat16" (or "float16") a copy cast.
    "sampler_dtype": "",
    # Sampler/trainer mismatch: "none", "token_truncate" (truncated importance sampling: each
    # token's loss times min(p_trainer / p_sampler, cap)) or "token_mask" (0 above the cap).
    "sampler_correction": "none",
    "sampler_correction_cap": 3.0,
    # DAPO's soft overlong punishment: 0 off; else the last soft_punish_cache tokens before
    # max_new_tokens cost up to soft_punish_factor of reward, linearly.
    "soft_punish_cache": 0,
    "soft_punish_factor": 1.0,
    # Episodes in which the model calls tools (common/tasks/episodes.py, docs/tools.md): on where
    # tools or an environment is named. tools: comma-separated FILE.py:NAME or module:NAME
    # (functions); environment: FILE.py:NAME of a class (TRL's environment_factory).
    "tools": "",
    "environment": "",
    # The call forms read: the template's own, and those small models write (common/tasks/
    # tool_calls.py); the weight of a reward for calls in the template's own format (0: none).
    "call_forms": "template,json_fence,json",
    "call_format_reward": 0.0,
    "max_turns": 4,  # the model's turns in an episode
    "max_episode_tokens": 512,  # after the prompt: the model's and the context's
    "tool_timeout_s": 10.0,  # a call's time limit
  }
  unknown = set(kw) - set(cfg)
  if unknown:
    raise UserError(f"Unknown grpo keys {sorted(unknown)}; known: {sorted(cfg)}.")
  cfg.update(kw)
  return ml_collections.ConfigDict(cfg)


def token_logps(model, batch: dict, temperature: float = 1.0, loss_chunk: int = 0) -> jax.Array:
  """[R, L - 1] log-probability of each next token of the rows (under logits / temperature);
  `loss_chunk` (train.loss_chunk): the head run that many tokens at a time, the [R, L, V]
  logits never whole (`losses.decoder_token_logps`)."""
  rows = losses.next_token_rows(batch)
  inputs, pos, seg = rows["inputs"], rows["positions"], rows["segment_ids"]
  if loss_chunk:
    return losses.decoder_token_logps(
      model,
      inputs,
      seg,
      rows["targets"],
      chunk=loss_chunk,
      positions_BT=pos,
      temperature=temperature,
    )
  logits = model(inputs, positions_BT=pos, segment_ids_BT=seg)
  return -parallel.cross_entropy(logits.astype(jnp.float32) / temperature, rows["targets"])


def advantages(
  rewards_R: np.ndarray, group_size: int, scale: str = "group", *, batch_std: float | None = None
) -> np.ndarray:
  """Each completion's reward against its group's mean (the rows of a group side by side), over
  the group's (or the batch's) unbiased standard deviation + 1e-4, or not scaled. `batch_std`:
  the batch's, where the batch is more than these rows (every process's, `scale="batch"`)."""
  grouped = rewards_R.reshape(-1, group_size)
  centred = (grouped - grouped.mean(axis=1, keepdims=True)).reshape(-1)
  if scale == "group":
    std = np.repeat(grouped.std(axis=1, ddof=1) if group_size > 1 else 0.0, group_size)
    return centred / (std + 1e-4)
  if scale == "batch":
    return centred / ((rewards_R.std(ddof=1) if batch_std is None else batch_std) + 1e-4)
  return centred


def soft_overlong(length_R: np.ndarray, max_new_tokens: int, cache: int) -> np.ndarray:
  """DAPO's soft overlong punishment (arXiv 2503.14476, eq. 13) of completions of `length_R`
  tokens, at most max_new_tokens (L_max): 0 up to L_max - cache, then falling linearly to -1 at
  L_max."""
  start = max_new_tokens - cache
  return np.where(length_R <= start, 0.0, (start - length_R) / max(cache, 1)).clip(-1.0, 0.0)


def uses_sampler_logps(s) -> bool:
  """Whether the rollouts carry the sampler's log-probabilities of their tokens (the mismatch
  correction, or a sampler in another dtype, whose mismatch is logged): only where they are
  those of the distribution that drew the tokens (temperature 1, no top-k or top-p; the
  engine's log-probabilities are the logits' own)."""
  plain = s.temperature == 1.0 and not s.top_k and s.top_p >= 1.0
  return s.sampler_correction != "none" or (bool(s.sampler_dtype) and plain)


# Several processes: each samples, scores and weighs its own prompts' groups; these move what
# must be shared.


def gather(x: np.ndarray) -> np.ndarray:
  """Every process's `x` [n, ...] (the same shape on each), concatenated in process order (the
  batch's row order): `x` itself in one process."""
  if jax.process_count() == 1:
    return x
  from jax.experimental import multihost_utils

  return np.asarray(multihost_utils.process_allgather(np.asarray(x), tiled=True))


def local_rows(x) -> np.ndarray:
  """This process's rows of a batch array (placed over the mesh's batch axes): the whole array
  in one process; else the rows its devices hold, each once, in order."""
  if not isinstance(x, jax.Array) or x.is_fully_addressable:
    return np.asarray(jax.device_get(x))
  blocks = {}
  for shard in x.addressable_shards:
    blocks.setdefault(shard.index[0].start or 0, shard)
  return np.concatenate([np.asarray(blocks[k].data) for k in sorted(blocks)])


_WHOLE: dict = {}


def whole_here(params):
  """The weights as one process samples with them: across processes, a whole copy on this
  process's first device (gathered from wherever the mesh keeps them); in one process, as
  they are."""
  if jax.process_count() == 1:
    return params
  leaves, treedef = jax.tree.flatten(params)
  shardings = tuple(
    parallel.NamedSharding(x.sharding.mesh, parallel.P())
    if isinstance(getattr(x, "sharding", None), parallel.NamedSharding)
    else None
    for x in leaves
  )
  key = (treedef, shardings, tuple((x.shape, str(x.dtype)) for x in leaves))
  if key not in _WHOLE:
    _WHOLE[key] = jax.jit(lambda *xs: xs, out_shardings=shardings)
  gathered = _WHOLE[key](*leaves)
  return jax.tree.unflatten(treedef, [x.addressable_data(0) for x in gathered])


def place_rows(arrays: dict, layout) -> dict:
  """Host rows as the step takes them, split over the batch axes of the mesh: each process
  gives its own rows (`parallel.process_block`), which together are the global batch."""
  if layout is None:
    return {k: jnp.asarray(v) for k, v in arrays.items()}
  sharding = parallel.NamedSharding(layout.mesh, layout.batch_spec)
  if jax.process_count() == 1:
    return {k: jax.device_put(v, sharding) for k, v in arrays.items()}
  shards = math.prod(layout.sizes[a] for a in parallel.BATCH_AXES)
  held = parallel.process_block(layout, layout.batch_spec, (shards,))[0]
  out = {}
  for k, v in arrays.items():
    shape = (len(v) * shards // (held.stop - held.start), *v.shape[1:])
    out[k] = jax.make_array_from_process_local_data(sharding, v, shape)
  return out


def episodic(s) -> bool:
  """Whether the rollouts are episodes with tools (grpo.tools or grpo.environment set)."""
  return bool(s.tools or s.environment)


def completion_cap(s) -> int:
  """The most trained tokens a completion holds: max_new_tokens, or an episode's model tokens
  (dr_grpo's denominator, the soft overlong punishment's L_max)."""
  return episodes.settings_of(s).model_token_cap if episodic(s) else s.max_new_tokens


def configure_episodes(s) -> "episodes.Agent":
  """The tools and environment of grpo.tools / grpo.environment, loaded and checked, and the
  settings episodes refuse."""
  for key, least in (("max_turns", 1), ("max_episode_tokens", 1)):
    if s[key] < least:
      raise UserError(f"grpo.{key}={s[key]}: give {least} or more.")
  if s.tool_timeout_s < 0:
    raise UserError(f"grpo.tool_timeout_s={s.tool_timeout_s}: give 0 (no limit) or more seconds.")
  if s.max_episode_tokens < s.max_new_tokens:
    raise UserError(
      f"grpo.max_episode_tokens={s.max_episode_tokens} is less than max_new_tokens="
      f"{s.max_new_tokens}: an episode holds its turns."
    )
  functions = tools_lib.load_tools(s.tools) if s.tools else []
  environment = tools_lib.load_environment(s.environment) if s.environment else None
  return episodes.Agent(functions, environment, forms=s.call_forms)


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


def sampler_rows(logps_RN: np.ndarray, lengths_R: np.ndarray, width: int) -> np.ndarray:
  """The sampler's log-probs of each row's new tokens [R, N] laid as `token_logps` lays the
  trainer's, [R, width - 1]: new token j of row r (at position lengths_R[r] + j) at index
  lengths_R[r] + j - 1."""
  R, N = logps_RN.shape
  out = np.zeros((R, width - 1), np.float32)
  for r in range(R):
    if lengths_R[r] > 0:
      out[r, lengths_R[r] - 1 : lengths_R[r] - 1 + N] = logps_RN[r]
  return out


def widen(rows: dict, width: int) -> dict:
  """Training rows [R, L] (and [R, L - 1]) padded on the right to `width` tokens: nothing."""
  extra = width - rows["tokens"].shape[1]
  if extra <= 0:
    return rows
  return {k: np.pad(v, ((0, 0), (0, extra))) if v.ndim == 2 else v for k, v in rows.items()}


class GRPO(tasks.Task):
  name = "grpo"
  decoder = True

  def __init__(self, settings=None, rewards=(), agent=None):
    self.s = settings
    # The reward functions; those with fn None are an episode's own (environment, call_format).
    self.rewards = list(rewards)
    self.agent = agent  # episodes with tools (grpo.tools / grpo.environment), else None
    if settings is not None:
      self.rows_per_example = settings.group_size
    self._metrics: dict[str, list[float]] = {}

  # The step

  def loss_sums(self, model, batch, *, loss_chunk=0):
    s = self.s
    rows = losses.next_token_rows(batch)
    w = rows["weights"]  # [R, L - 1]: the completion's tokens as targets
    logp = token_logps(model, batch, s.temperature, loss_chunk)
    # The trainer's log-probs on the rollout's weights: the batch's (num_iterations > 1, taken
    # as the rollout was made), else the current ones detached (the same weights).
    old = batch["old_logps"] if "old_logps" in batch else jax.lax.stop_gradient(logp)
    log_ratio = logp - old
    if s.importance_sampling_level == "sequence":  # GSPO: a completion's mean log-ratio
      length = jnp.maximum(jnp.sum(w, axis=1, keepdims=True), 1.0)
      log_ratio = jnp.sum(log_ratio * w, axis=1, keepdims=True) / length
    ratio = jnp.exp(log_ratio)
    a = batch["advantages"][:, None]
    clipped = jnp.clip(ratio, 1 - s.epsilon, 1 + (s.epsilon_high or s.epsilon))
    per_token = -jnp.minimum(ratio * a, clipped * a)
    tokens = jnp.maximum(jnp.sum(w), 1.0)
    if "sampler_logps" in batch:
      # The sampler's tokens under the trainer (p) and the sampler (q): KL(q || p) by k3 over
      # q's samples, and the correction's weight p / q (TRL's vllm_importance_sampling_*).
      d = old - batch["sampler_logps"]
      aux.add("sampler_kl", jnp.sum((jnp.exp(d) - d - 1) * w) / tokens, weight=0.0)
      if s.sampler_correction != "none":
        is_ratio, cap = jnp.exp(d), s.sampler_correction_cap
        if s.sampler_correction == "token_truncate":
          is_weight = jnp.minimum(is_ratio, cap)
        else:  # token_mask
          is_weight = jnp.where(is_ratio > cap, 0.0, is_ratio)
        aux.add("sampler_capped", jnp.sum((is_ratio > cap) * w) / tokens, weight=0.0)
        per_token = per_token * jax.lax.stop_gradient(is_weight)
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
    if s.loss_type == "dr_grpo":  # a constant denominator: completions x their most tokens
      return total, jnp.asarray(w.shape[0] * completion_cap(s), jnp.float32)
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
    if episodic(s):
      L = cfg.data.seq_len + s.max_episode_tokens
    shapes = tasks.token_rows(R, L)
    shapes.update(loss_weights=((R, L), np.float32), advantages=((R,), np.float32))
    for key, wanted in (("reference", s.beta), ("old_logps", s.num_iterations > 1),
                        ("sampler_logps", uses_sampler_logps(s))):  # fmt: skip
      if wanted:
        shapes[key] = ((R, L - 1), np.float32)
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
    s = config(**cfg.grpo.to_dict())  # a section saved before a key: its default
    for key, known in (("loss_type", LOSS_TYPES), ("scale_rewards", SCALES),
                       ("truncated", TRUNCATED), ("importance_sampling_level", LEVELS),
                       ("sampler_correction", CORRECTIONS),
                       ("sampler_dtype", SAMPLER_DTYPES)):  # fmt: skip
      if s[key] not in known:
        shown = ", ".join(repr(k) for k in known)
        raise UserError(f"Unknown grpo.{key} {s[key]!r}: use one of {shown}.")
    for key, least in (("num_iterations", 1), ("filter_max_rounds", 1),
                       ("soft_punish_cache", 0)):  # fmt: skip
      if s[key] < least:
        raise UserError(f"grpo.{key}={s[key]}: give {least} or more.")
    if s.soft_punish_cache > s.max_new_tokens:
      raise UserError(
        f"grpo.soft_punish_cache={s.soft_punish_cache} is more than max_new_tokens="
        f"{s.max_new_tokens}: the punishment's window is the last tokens before max_new_tokens."
      )
    if s.sampler_correction != "none":
      if s.sampler_correction_cap <= 0:
        raise UserError(f"grpo.sampler_correction_cap={s.sampler_correction_cap}: give > 0.")
      if s.temperature != 1.0 or s.top_k or s.top_p < 1.0:
        raise UserError(
          "grpo.sampler_correction weighs each token by p_trainer / p_sampler, and the engine's "
          "log-probabilities are its logits' own: set grpo.temperature=1, top_k=0, top_p=1."
        )
    if s.group_size < 2:
      raise UserError(
        f"grpo.group_size={s.group_size}: a group needs 2 completions or more, its advantages "
        "being relative to each other."
      )
    if s.max_new_tokens < 1:
      raise UserError(f"grpo.max_new_tokens={s.max_new_tokens}: sample 1 token or more.")
    agent = None
    if episodic(s):
      agent = configure_episodes(s)
    builtin = []
    if agent is not None and tools_lib.has_reward(agent.environment):
      builtin.append(rewards_lib.Reward("environment", None, 1.0))
    if agent is not None and s.call_format_reward:
      builtin.append(rewards_lib.Reward("call_format", None, float(s.call_format_reward)))
    functions = rewards_lib.load(s.reward) if s.reward or not builtin else []
    return GRPO(s, functions + builtin, agent)

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
    # The training prompts, as the trainer draws them: the task draws more (dynamic sampling)
    # and keeps a rollout for its updates (num_iterations) through them (`PromptStream`).
    from nnx_zoo.common.data import pipeline

    self._stream = data.iterator if isinstance(data.iterator, pipeline.PromptStream) else None
    training = data.iterator is not None  # `zoo eval` loads the held-out split alone
    if self._stream is None and training and (s.num_iterations > 1 or s.filter_tied_groups):
      raise UserError(
        "grpo.num_iterations > 1 and grpo.filter_tied_groups draw on the prompts' stream of "
        f"data.format=prompts, which data.kind={cfg.data.kind!r} does not give."
      )
    # Each split's records (their fields reach the rewards by the index each row carries): the
    # held-out split's from `data`; the training split's, which the data kind hands the trainer
    # as an iterator only, read again on the first training step.
    self._splits = {} if data.eval is None else {"eval": data.eval}
    self._data_cfg = cfg.data
    graphdef = nnx.graphdef(models.abstract(cfg.model))
    # The sampler's model: the run's, or (grpo.sampler_dtype) the same computing in that dtype.
    sampler_graphdef = graphdef
    if s.sampler_dtype:
      model_cfg = ml_collections.ConfigDict(cfg.model.to_dict())
      model_cfg.dtype = model_cfg.param_dtype = s.sampler_dtype
      sampler_graphdef = nnx.graphdef(models.abstract(model_cfg))
    # The sampler ends early once every row has written a one-token stop (HF templates' end of
    # turn, the end token): the rest of the rows is cut away here anyway.
    if self.agent is not None:
      self.agent.prepare(template, self._tokenizer)
      self._graphdef = sampler_graphdef
    single = tuple(sorted({int(stop[0]) for stop in self._stops if len(stop) == 1}))
    self._sampling = dict(
      graphdef=sampler_graphdef, max_new_tokens=s.max_new_tokens, stop_ids=single
    )
    temperature = float(s.temperature)
    chunk = cfg.train.loss_chunk
    self._trainer_logps = jax.jit(
      lambda p, b: token_logps(nnx.merge(graphdef, p), b, temperature, chunk)
    )
    self._reference = None
    if s.beta:
      if not cfg.init_from:
        raise UserError(
          "grpo.beta > 0 keeps the policy near a reference model, the weights it starts from: "
          "set --config.init_from (or grpo.beta=0, no reference)."
        )
      self._reference = reference.Reference(cfg, layout)
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

  def _sampler_params(self, params):
    """The weights the sampler runs on: the params (a whole copy on this process's device
    across processes), cast to grpo.sampler_dtype if set."""
    params = whole_here(params)
    dtype = self.s.sampler_dtype
    if not dtype:
      return params
    cast = lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
    return jax.tree.map(cast, params)

  def _rollouts(self, params, prompts_RP, lengths_R, keys_R, *, split: str):
    """(out [R, P + N], logps [R, N] or None): each row's prompt and its completion, sampled
    (training) or greedy (through the engine, `engine.continue_rows`); with the sampler's
    log-probability of each new token where the run takes them (`uses_sampler_logps`)."""
    s = self.s
    _, prefill = self._split(split)
    if split == "train":
      options = dict(temperature=float(s.temperature), top_k=int(s.top_k), top_p=float(s.top_p))
    else:
      options = dict(temperature=0.0)
    if split != "train" or not uses_sampler_logps(s):
      out = engine.continue_rows(
        params, prompts_RP, lengths_R, keys_R, prefill=prefill, **self._sampling, **options
      )
      return np.asarray(jax.device_get(out)), None
    return self._rollouts_with_logps(params, prompts_RP, lengths_R, keys_R, **options)

  def _rollouts_with_logps(self, params, prompts_RP, lengths_R, keys_R, **options):
    """`engine.continue_rows` with each new token's log-probability under the sampler."""
    return engine.continue_rows(
      params, prompts_RP, lengths_R, keys_R, logprobs=True, **self._sampling, **options
    )

  # Before each step: the rollouts

  def complete(self, batch, params):
    if not hasattr(self, "_sampling"):
      raise RuntimeError("GRPO.complete before prepare: the trainer prepares the task first.")
    start = time.perf_counter()
    jax.block_until_ready(params)  # the previous step's update: training time, not sampling
    ready = time.perf_counter()
    if "seed" not in batch:  # held out: each prompt once, greedy
      host = {k: local_rows(batch[k]) for k in ("tokens", "segment_ids", "index")}
      if self.agent is not None:
        _, scored, _ = self._episodes(host, whole_here(params), training=False)
      else:
        lengths_R, out, _ = self._rollout(host, whole_here(params), training=False)
        _, scored, _ = self._score(out, lengths_R, host["index"], lengths_R > 0, False)
      return {**batch, **self._place(scored)}
    held = None if self._stream is None else self._stream.held
    if held is not None:  # another update on the rollout the last step made (num_iterations)
      return self._place(held)
    times = {"sample_s": 0.0, "reward_s": 0.0}
    rows, scored, info = self._fill(batch, params, times)
    rows = self._place(rows)
    if self.s.num_iterations > 1:
      # The ratio's denominator: the trainer's log-probs on the rollout's weights, as TRL takes
      # them; the rows and these ride in the prompts' stream until the rollout's last update.
      rows["old_logps"] = self._trainer_logps(params, rows)
    if self.s.beta:
      rows["reference"] = self._trainer_logps(self._reference.params(params), rows)
    if self.s.num_iterations > 1:
      held = {k: local_rows(v) for k, v in rows.items()}
      self._stream.hold(held, self.s.num_iterations - 1)
    self._log(scored, train_s=ready - (self._since or start), **times, **info)
    self._since = time.perf_counter()
    return rows

  def _fill(self, batch, params, times):
    """(rows, scored, info): this process's rows of the training batch (its prompts' groups,
    sampled, scored and weighed), what every process sampled (scored, for the log) and, under
    grpo.filter_tied_groups, the rounds it took. Dynamic sampling draws more prompts from the
    stream until each process has its share of groups whose rewards do not all tie, or
    filter_max_rounds rounds have run (every process runs as many); a batch still short trains
    on what it has, the rest of its rows empty."""
    s = self.s
    host = {k: local_rows(batch[k]) for k in ("tokens", "segment_ids", "index", "seed")}
    B = len(host["index"])  # this process's prompts
    sampler = self._sampler_params(params)
    if s.filter_tied_groups and self.agent is None and jax.process_count() == 1 and s.refill:
      parts, kept = self._refilled(host, sampler, times)
    else:
      parts, kept = self._rounds(host, sampler, times)
    return self._batch(parts, kept, B, times)

  def _rounds(self, host, sampler, times):
    """Dynamic sampling a round at a time (and a step's one round without it): (parts, kept),
    parts [(rows, scored)] a round each, kept the (round, group) of each untied group."""
    s, G = self.s, self.s.group_size
    B = len(host["index"])
    parts, kept = [], []
    while True:
      if self.agent is not None:  # episodes: their sampling and tools, then their scoring
        rows, scored, _ = self._episodes(host, sampler, training=True, times=times)
      else:
        t0 = time.perf_counter()
        lengths_R, out, logps = self._rollout(host, sampler, training=True)
        t1 = time.perf_counter()
        index_R = np.repeat(host["index"], G)
        rows, scored, _ = self._score(out, lengths_R, index_R, lengths_R > 0, True)
        if logps is not None:
          rows["sampler_logps"] = sampler_rows(logps, lengths_R, out.shape[1])
        times["sample_s"] += t1 - t0
        times["reward_s"] += time.perf_counter() - t1
      parts.append((rows, scored))
      if not s.filter_tied_groups:
        break
      tied = np.ptp(scored["reward"].reshape(-1, G), axis=1) == 0
      kept += [(len(parts) - 1, g) for g in np.flatnonzero(~tied)]
      short = int(gather(np.asarray([B - len(kept)])).max())
      if short <= 0 or len(parts) >= s.filter_max_rounds:
        break
      host = dict(self._stream.more())
    return parts, kept

  def _refilled(self, host, sampler, times):
    """Dynamic sampling on one engine (one process): the next round's prompts are drawn and
    queued as soon as the rounds so far cannot fill the batch (the untied groups found plus
    those still running fall short), so their rows take the slots of finished rows instead of
    waiting for the round's longest. The rounds drawn, and each row's tokens (its own key,
    whatever its slot), are those of `_rounds`: the same (parts, kept)."""
    s, G = self.s, self.s.group_size
    B = len(host["index"])
    options = dict(temperature=float(s.temperature), top_k=int(s.top_k), top_p=float(s.top_p))
    rows = engine.Rows(
      self._sampling["graphdef"], sampler, slots=B * G, prompt_len=host["tokens"].shape[1],
      max_new_tokens=s.max_new_tokens, stop_ids=self._sampling["stop_ids"],
      logprobs=uses_sampler_logps(s), **options,
    )  # fmt: skip
    rounds = []  # [lengths_R, index_R, rows left in each group, scored groups {g: (rows, scored)}]
    kept = []

    def draw(host):
      prompts_RP, lengths_R, keys = self._rollout_rows(host, training=True)
      _, padding = rows.add(prompts_RP, lengths_R, keys)
      left = np.full(len(lengths_R) // G, G)
      rounds.append([lengths_R, np.repeat(host["index"], G), left, {}])
      return [(len(rounds) - 1, b) for b in padding]

    def score(i, g):
      lengths_R, index_R, _, groups = rounds[i]
      out, logps = rows.result(i)
      block = slice(g * G, (g + 1) * G)
      t = time.perf_counter()
      part, scored, _ = self._score(out[block], lengths_R[block], index_R[block],
                                    lengths_R[block] > 0, True)  # fmt: skip
      if rows.logprobs:
        part["sampler_logps"] = sampler_rows(logps[block], lengths_R[block], out.shape[1])
      times["reward_s"] += time.perf_counter() - t
      groups[g] = (part, scored)
      if np.ptp(scored["reward"]) > 0:
        kept.append((i, g))

    finished = draw(host)
    while True:
      for i, b in finished:
        rounds[i][2][b // G] -= 1
        if rounds[i][2][b // G] == 0:
          score(i, b // G)
      running = sum(int((r[2] > 0).sum()) for r in rounds)
      if len(kept) + running < B and len(rounds) < s.filter_max_rounds:
        finished = draw(dict(self._stream.more()))
        continue
      if not rows.busy:
        break
      t = time.perf_counter()
      finished = rows.step()
      times["sample_s"] += time.perf_counter() - t
    parts = []
    for _, _, left, groups in rounds:
      ordered = [groups[g] for g in range(len(left))]
      parts.append(
        tuple(
          {k: np.concatenate([p[j][k] for p in ordered]) for k in ordered[0][j]} for j in (0, 1)
        )  # fmt: skip
      )
    return parts, sorted(kept)

  def _batch(self, parts, kept, B, times):
    """The training batch of the rounds `parts` and their untied groups `kept` (see _fill)."""
    s, G = self.s, self.s.group_size
    # Every process's rows as wide as the widest (one global batch).
    width = int(gather(np.asarray([max(r["tokens"].shape[1] for r, _ in parts)])).max())
    if not s.filter_tied_groups:
      rows, scored = parts[0]
      rows = widen(rows, width)
      reward, info = scored["reward"], {}
    else:
      chosen = kept[:B]
      wide = widen(parts[0][0], width)
      rows = {k: np.zeros((B * G, *v.shape[1:]), v.dtype) for k, v in wide.items()}
      reward = np.zeros(B * G, np.float32)
      for slot, (part, g) in enumerate(chosen):
        block, to = slice(g * G, (g + 1) * G), slice(slot * G, (slot + 1) * G)
        for k, v in widen(parts[part][0], width).items():
          rows[k][to] = v[block]
        reward[to] = parts[part][1]["reward"][block]
      filled = gather(np.asarray([len(chosen)]))
      info = {
        "sampling_rounds": float(len(parts)),
        "sampled_prompts": float(len(parts) * B * jax.process_count()),
        "unfilled_groups": float(B * jax.process_count() - filled.sum()),
      }
      scored = {k: np.concatenate([sc[k] for _, sc in parts]) for k in parts[0][1]}
    batch_std = None
    if s.scale_rewards == "batch" and (jax.process_count() > 1 or s.filter_tied_groups):
      real = rows["segment_ids"].any(axis=1)
      everyone = gather(np.where(real, reward, np.nan))
      batch_std = float(np.nanstd(everyone, ddof=1))
    rows["advantages"] = advantages(reward, G, s.scale_rewards, batch_std=batch_std).astype(
      np.float32
    )
    scored = {k: gather(v) for k, v in scored.items()}  # what every process sampled: the log
    return rows, scored, info

  def _rollout(self, host, params, *, training: bool):
    """(lengths_R, out [R, P + N], logps): a training batch's prompts (it carries their
    rollouts' seeds) each continued group_size times, sampled; a held-out batch's once, greedy.
    A held-out batch's padding rows have length 0. `host`: this process's rows of the batch;
    `params`: the sampler's (`_sampler_params`)."""
    prompts_RP, lengths_R, keys = self._rollout_rows(host, training=training)
    split = "train" if training else "eval"
    out, logps = self._rollouts(params, prompts_RP, lengths_R, keys, split=split)
    return lengths_R, out, logps

  def _rollout_rows(self, host, *, training: bool):
    """The rows a batch's rollout continues: prompts [R, P] (each prompt group_size times in
    training, once held out; P its longest in the sampler's bucket), lengths [R] and keys [R]."""
    lengths = host["segment_ids"].sum(axis=1).astype(np.int32)
    P = rows_width(int(lengths.max()), host["tokens"].shape[1])
    G = self.s.group_size if training else 1
    prompts_RP, lengths_R = np.repeat(host["tokens"][:, :P], G, axis=0), np.repeat(lengths, G)
    if training:
      keys = jax.vmap(jax.random.key)(jnp.asarray(np.repeat(host["seed"], G), jnp.uint32))
      keys = jax.vmap(jax.random.fold_in)(keys, jnp.tile(jnp.arange(G), len(host["seed"])))
    else:  # greedy: the keys are not read
      keys = jax.vmap(jax.random.key)(jnp.zeros(len(lengths_R), jnp.uint32))
    return prompts_RP, lengths_R, keys

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
    training = split == "train"
    G = self.s.group_size if training else 1
    index_R = np.repeat(batch["index"], G)
    if self.agent is not None:  # each episode turn by turn
      _, scored, texts = self._episodes(batch, self._sampler_params(params), training=training)
      valid = scored["valid"] > 0
    else:
      lengths_R, out, _ = self._rollout(batch, self._sampler_params(params), training=training)
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
    t = np.arange(L)[None]
    end = (lengths_R + kept)[:, None]
    segment_ids = ((t < end) & valid[:, None]).astype(np.int32)
    model = (t >= lengths_R[:, None]) & (t < end)
    rows, scored = self._rewarded(
      out, segment_ids, model, kept, truncated, valid, (prompts, completions, fields), training
    )
    return rows, scored, texts

  def _rewarded(self, tokens, segment_ids, model, kept, truncated, valid, scoring, training,
                own=None):  # fmt: skip
    """The training rows and what is logged of completions: `tokens` [R, L] (a row's prompt and
    completion, `segment_ids` over them), `model` [R, L] the tokens trained on (the completion's,
    an episode's model tokens), `kept` [R] how many, `truncated`, `valid` [R]; `scoring`: the
    valid rows' (prompts, completions, fields) for the reward functions; `own`: the values of
    the rewards that are an episode's own (no fn), by name."""
    s, R = self.s, len(valid)
    prompts, completions, fields = scoring
    live = np.flatnonzero(valid)
    split = "train" if training else "eval"
    if any(len(v) != len(live) for v in fields.values()):
      raise UserError(
        f"The {split} prompt records do not all have the same fields ({', '.join(fields)}): "
        "the rewards take each field as one list, a value a completion."
      )
    per_fn = np.zeros((R, len(self.rewards)))
    called = [f for f, r in enumerate(self.rewards) if r.fn is not None]
    if called:
      values = rewards_lib.score([self.rewards[f] for f in called], prompts, completions, fields)
      per_fn[np.ix_(live, called)] = values.T
    for f, r in enumerate(self.rewards):
      if r.fn is None:
        per_fn[:, f] = own[r.name] * valid
    reward = per_fn @ np.asarray([r.weight for r in self.rewards])
    overlong = np.zeros(R)
    if training and s.soft_punish_cache:  # DAPO's soft overlong punishment (training only)
      cap = completion_cap(s)
      overlong = s.soft_punish_factor * soft_overlong(kept, cap, s.soft_punish_cache) * valid
      reward = reward + overlong
    if s.truncated == "penalize":
      reward = np.where(truncated, s.truncated_reward, reward)
    loss_weights = model.astype(np.float32)
    if s.truncated == "mask":
      loss_weights = loss_weights * ~truncated[:, None]
    rows = {
      "tokens": np.where(segment_ids > 0, tokens, 0).astype(np.int32),
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
    if training and s.soft_punish_cache:
      scored["overlong_penalty"] = overlong.astype(np.float32)
    return rows, scored

  def _episodes(self, host, params, *, training: bool, times=None):
    """Like `_rollout` then `_score`, for episodes with tools (common/tasks/episodes.py): a
    training batch's prompts each played group_size times, sampled; a held-out batch's once,
    greedy. (rows, scored, transcripts): the rows' loss weights on the model's tokens only, and
    `scored` with each episode's turns, calls, tool errors and tokens beside its rewards."""
    s = self.s
    t0 = time.perf_counter()
    G = s.group_size if training else 1
    split = "train" if training else "eval"
    records, _ = self._split(split)
    lengths = host["segment_ids"].sum(axis=1)
    index_R = np.repeat(host["index"], G)
    valid = np.repeat(lengths > 0, G)
    if training:
      keys = jax.vmap(jax.random.key)(jnp.asarray(np.repeat(host["seed"], G), jnp.uint32))
      keys = jax.vmap(jax.random.fold_in)(keys, jnp.tile(jnp.arange(G), len(host["seed"])))
    else:  # greedy: the keys are not read
      keys = jax.vmap(jax.random.key)(jnp.zeros(len(index_R), jnp.uint32))
    live = np.flatnonzero(valid)
    starts = []
    for r in live:
      record = records[index_R[r]]
      fields = {k: v for k, v in record.items() if k != "prompt"}
      starts.append((record["prompt"], fields, keys[r]))
    settings = episodes.settings_of(s, greedy=not training)
    seq_len = self._data_cfg.seq_len
    make = episodes.engine_for(self._graphdef, params, settings)
    played = self.agent.run(starts, settings, engine_for=make, max_prompt=seq_len,
                            logprobs=training and uses_sampler_logps(s))  # fmt: skip
    t1 = time.perf_counter()
    R = len(valid)
    full = [None] * R
    for r, ep in zip(live, played, strict=True):
      full[r] = ep
    widest = max((len(ep.tokens) for ep in played), default=1)
    width = min(engine.bucket(widest, minimum=engine.PROMPT_BUCKET),
                seq_len + s.max_episode_tokens)  # fmt: skip
    laid = episodes.rows(full, width)
    kept = np.zeros(R, np.int32)
    truncated = np.zeros(R, bool)
    kept[live] = [ep.model_tokens for ep in played]
    truncated[live] = [ep.truncated for ep in played]
    prompts = [p for p, _, _ in starts]
    completions = [ep.messages for ep in played]
    fields = {}
    for _, f, _ in starts:
      for k, v in f.items():
        fields.setdefault(k, []).append(v)
    own = {}
    if any(r.name == "environment" and r.fn is None for r in self.rewards):
      own["environment"] = np.zeros(R)
      own["environment"][live] = episodes.environment_rewards(played)
    if any(r.name == "call_format" and r.fn is None for r in self.rewards):
      own["call_format"] = np.zeros(R)
      own["call_format"][live] = episodes.template_format_share(played)
    rows, scored = self._rewarded(
      laid["tokens"], laid["segment_ids"], laid["model"], kept, truncated, valid,
      (prompts, completions, fields), training, own,
    )  # fmt: skip
    if "sampler_logps" in laid:
      rows["sampler_logps"] = laid["sampler_logps"]
    for k, v in episodes.stats(played).items():
      scored[k] = np.zeros(R, np.float32)
      scored[k][live] = v
    texts = [""] * R
    for r, ep in zip(live, played, strict=True):
      texts[r] = episodes.transcript(ep)
    if times is not None:
      times["sample_s"] += t1 - t0
      times["reward_s"] += time.perf_counter() - t1
    return rows, scored, texts

  def _place(self, arrays: dict) -> dict:
    """This process's host rows as the step takes them: split over the batch axes of the mesh
    (`place_rows`)."""
    return place_rows(arrays, self._layout)

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
    if "overlong_penalty" in scored:
      m["overlong_penalty"] = float(scored["overlong_penalty"].mean())
    if "turns" in scored:  # episodes: means per episode, and the share of calls that parsed
      for k in episodes.stats([]):
        m[k] = float(scored[k].mean())
      tried = scored["tool_calls"].sum() + scored["unparsed_turns"].sum()
      m["calls_parsed"] = float(scored["tool_calls"].sum() / tried) if tried else 1.0
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
