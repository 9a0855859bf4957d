"""What `zoo serve` loads from a workdir: the decoder's weights in an engine, the tokenizer, the
chat template with where a reply ends, and the tool-call format the template defines."""

import dataclasses
import os

import jax
import jax.numpy as jnp
from flax import nnx

from nnx_zoo.common import engine, files, models, tasks
from nnx_zoo.common.data import chat, tokenizers
from nnx_zoo.common.errors import UserError
from nnx_zoo.common.hub import generation, weights
from nnx_zoo.common.tasks import tool_calls

DEFAULT_MAX_LEN = 2048  # the KV cache's length per slot unless --max-len says otherwise
DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass
class Served:
  """A loaded model, as the endpoints use it."""

  engine: object  # engine.Engine (or a stand-in with its interface, in tests)
  tokenizer: tokenizers.Tokenizer
  vocab_size: int
  eos_ids: tuple[int, ...] = ()  # where any reply ends (the end token)
  template: chat.Template | None = None
  no_template: str = ""  # why there is no chat template
  chat_stop_ids: tuple[int, ...] = ()  # where a chat reply ends: the end token, the end of turn
  chat_stops: tuple[str, ...] = ()  # the end of turn, where it is more than one token
  tool_parser: tool_calls.Parser | None = None

  @property
  def max_len(self) -> int:
    return self.engine.max_len


def context_length(cfg) -> int:
  """The model's own context: its Hugging Face config's, else the run's rows (0: unknown)."""
  source = cfg.source.config.to_dict() if "source" in cfg and "config" in cfg.source else {}
  source = source.get("text_config") or source
  for key in ("max_position_embeddings", "n_positions", "n_ctx"):
    if source.get(key):
      return int(source[key])
  return int(cfg.get("data", {}).get("seq_len", 0) or 0)


def eos_ids(cfg, workdir: str, tokenizer) -> tuple[int, ...]:
  """The end tokens: generation_config.json's (else the HF config's) and the tokenizer's."""
  ids = [*(generation.end_ids(cfg, workdir) or ())]
  if tokenizer.eos_id is not None:
    ids.append(tokenizer.eos_id)
  return tuple(dict.fromkeys(int(i) for i in ids))


def cast(model_cfg, params, dtype: str):
  """The model config and params computing in `dtype` (params of a float type cast)."""
  model_cfg.dtype = model_cfg.param_dtype = dtype
  to = jnp.dtype(dtype)

  def one(x):
    return x.astype(to) if jnp.issubdtype(x.dtype, jnp.floating) else x

  return model_cfg, jax.tree.map(one, params)


def load(cfg, workdir: str, *, slots: int, max_len: int | None, dtype: str | None) -> Served:
  """The model of a workdir (a `zoo run` or `zoo convert` output; a LoRA run's adapters merged)
  in an engine of `slots` x `max_len` (default: the model's context, at most DEFAULT_MAX_LEN)."""
  tasks.decoder_task(cfg, "zoo serve", workdir)
  if dtype is not None and dtype not in DTYPES:
    raise UserError(f"--dtype {dtype!r}: use one of {', '.join(DTYPES)}.")
  tokenizer = tokenizers.load(cfg.data.tokenizer)
  template, no_template = None, ""
  try:
    template = chat.template(cfg.data)
  except UserError as e:
    no_template = str(e)
  context = context_length(cfg)
  if max_len is None:
    max_len = min(context, DEFAULT_MAX_LEN) if context else DEFAULT_MAX_LEN
  elif context and max_len > context:
    files.warn(f"--max-len {max_len} is beyond the model's context of {context} tokens.")
  model_cfg, params, _ = weights.read_zoo(workdir)  # LoRA (and QLoRA's base) merged
  if dtype is not None:
    model_cfg, params = cast(model_cfg, params, dtype)
  graphdef = nnx.graphdef(models.abstract(model_cfg))
  params = jax.tree.map(jnp.asarray, params)
  eng = engine.Engine((graphdef, params), slots=slots, max_len=max_len)
  eos = eos_ids(cfg, workdir, tokenizer)
  served = Served(eng, tokenizer, int(model_cfg.vocab_size), eos_ids=eos, no_template=no_template)
  if template is not None:
    served.template = template
    end = template.end_of_turn
    end_ids = tokenizer.encode_chat(end)[0].tolist() if end else []
    served.chat_stop_ids = tuple(dict.fromkeys([*eos, *(end_ids if len(end_ids) == 1 else [])]))
    served.chat_stops = (end,) if len(end_ids) > 1 else ()
    served.tool_parser = tool_calls.for_template(template.source)
  return served


def warm(served: Served):
  """One short greedy request through the engine: its programs compiled (or read from the
  persistent cache) before the server says it is ready."""
  eng = served.engine
  token = served.eos_ids[0] if served.eos_ids else 0
  eng.submit([token], engine.SamplingParams(max_tokens=2, temperature=0.0), seed=0)
  while eng.busy:
    eng.step()


def name_of(workdir: str) -> str:
  """The model's name by default: the workdir's (a file's without .gguf)."""
  base = os.path.basename(os.path.normpath(workdir))
  return base.removesuffix(".gguf") or "model"
