"""On-policy preference pairs: each prompt's rejected reply is the starting model's own
(`data.rejected="init_from"`), sampled once from the init_from weights with the zoo's batched,
compiled sampler (sampling's one loop, through `engine.continue_rows`) and cached, so a rerun
(or a resumed run) reads them instead of sampling again.

The cache is keyed by everything the replies depend on: the checkpoint (its path, and the size
and time of each of its files), the prompts, the chat template and the sampling settings.
"""

import hashlib
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nnx_zoo.common import engine, files
from nnx_zoo.common.hub import weights

BATCH = 16  # prompts sampled at once
BUCKET = 32  # the smallest prompt bucket (engine.bucket: 32, 48, 64, 96, ...): a few programs


def _checkpoint_identity(path: str) -> list:
  path = os.path.abspath(weights.locate(path))
  found = []
  for root, _, names in os.walk(path):
    for name in sorted(names):
      stat = os.stat(os.path.join(root, name))
      found.append(
        [os.path.relpath(os.path.join(root, name), path), stat.st_size, stat.st_mtime_ns]
      )
  return [path, sorted(found)]


def replies(cfg, prompts: list[list[dict]], *, template, tokenizer) -> list[str]:
  """The init_from model's greedy reply to each prompt (a list of messages), rendered with the
  generation prompt and cut at the template's end of turn: read from the cache, or sampled
  (`data.rejected_max_tokens` new tokens at most) and cached."""
  max_new = int(cfg.data.rejected_max_tokens)
  key = json.dumps(
    {
      "checkpoint": _checkpoint_identity(cfg.init_from),
      "prompts": prompts,
      "template": template.source,
      "max_new_tokens": max_new,
      "sampling": "greedy",
    },
    sort_keys=True,
  )
  path = files.cache_dir("rollouts", hashlib.sha256(key.encode()).hexdigest()[:32] + ".json")
  if os.path.isfile(path):
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  out = _sample(cfg.init_from, prompts, template=template, tokenizer=tokenizer, max_new=max_new)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with files.replacing(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
    json.dump(out, f)
  return out


def _sample(init_from: str, prompts, *, template, tokenizer, max_new: int) -> list[str]:
  graphdef, params = nnx.split(weights.load(init_from))
  ids = [tokenizer.encode_chat(template.render(p, add_generation_prompt=True))[0] for p in prompts]
  order = np.argsort([len(x) for x in ids], kind="stable")  # like lengths together
  texts = [""] * len(ids)
  for start in range(0, len(order), BATCH):
    rows = list(order[start : start + BATCH])
    rows += rows[-1:] * (BATCH - len(rows))  # a full batch: one program for every batch
    lengths = np.array([len(ids[r]) for r in rows], np.int32)
    P = engine.bucket(int(lengths.max()), minimum=BUCKET)
    prompt_BP = np.zeros((BATCH, P), np.int32)
    for b, r in enumerate(rows):
      prompt_BP[b, : lengths[b]] = ids[r]
    out = engine.continue_rows(
      params,
      jnp.asarray(prompt_BP),
      jnp.asarray(lengths),
      jax.random.split(jax.random.key(0), BATCH),
      graphdef=graphdef,
      prefill=max(engine.bucket_below(int(lengths.min())), 1),  # a few programs, not one a length
      max_new_tokens=max_new,
      temperature=0.0,
      stop_ids=(tokenizer.eos_id,),  # cut there below anyway: the loop ends once all have it
    )
    out = np.asarray(out)
    for b, r in enumerate(rows):
      new = out[b, lengths[b] : lengths[b] + max_new].tolist()
      if tokenizer.eos_id is not None and tokenizer.eos_id in new:
        new = new[: new.index(tokenizer.eos_id)]
      text = tokenizer.decode(new)
      end = template.end_of_turn
      texts[r] = (text.split(end)[0] if end else text).strip()
  return texts
