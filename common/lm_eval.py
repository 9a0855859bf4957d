"""`zoo lm-eval`: EleutherAI's lm-evaluation-harness on a zoo decoder. `ZooLM` is an lm-eval
`LM` whose requests run batched and compiled, padded into a few length buckets, so a task
compiles a handful of programs; it scores as lm-eval's `hf` backend does (same tokenization,
windows, truncation and stop strings), to 1e-4 on the same weights."""

import difflib
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nnx_zoo.common import engine
from nnx_zoo.common.engine import bucket, bucket_below  # noqa: F401 (lm-eval's buckets)
from nnx_zoo.common.errors import UserError

DEFAULT_MAX_LENGTH = 2048  # lm-eval's, for a model whose config names no context length


def _import_lm_eval():
  try:
    import lm_eval  # noqa: F401
  except ImportError:
    raise UserError(
      "`zoo lm-eval` needs EleutherAI's lm-evaluation-harness: pip install nnx-zoo[lm-eval]"
    ) from None
  return lm_eval


def batch_rows(n: int, batch_size: int) -> int:
  """The rows of a batch holding `n` requests: the next power of two, at most `batch_size` (a
  task's last, short batch compiles a smaller program rather than computing empty rows)."""
  return min(batch_size, 1 << max(n - 1, 0).bit_length())


# --- the compiled programs: one per (batch, bucket) shape ---


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _score(params, tokens_BT, targets_BT, mask_BT, *, graphdef):
  """Per row, the summed log-probability (log_softmax in float32, read at the targets) of the
  masked targets, and whether every masked target is the argmax."""
  logits_BTV = nnx.merge(graphdef, params)(tokens_BT).astype(jnp.float32)
  logz_BT = jax.nn.logsumexp(logits_BTV, axis=-1)
  logp_BT = jnp.take_along_axis(logits_BTV, targets_BT[..., None], axis=-1)[..., 0] - logz_BT
  greedy_BT = jnp.argmax(logits_BTV, axis=-1) == targets_BT
  return jnp.sum(jnp.where(mask_BT, logp_BT, 0.0), axis=1), jnp.all(greedy_BT | ~mask_BT, axis=1)


# --- the lm-eval model ---


@functools.cache
def _lm_class():
  """`ZooLM`, defined once lm-eval is importable (it is an optional extra)."""
  _import_lm_eval()
  from lm_eval.api.model import TemplateLM
  from lm_eval.models import utils as lm_utils
  from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

  class ZooLM(TemplateLM):
    """A zoo decoder as lm-eval's `LM`: loglikelihood, loglikelihood_rolling, generate_until.

    Rows are sorted by length and padded on the right into buckets (`bucket`) and batches of
    `batch_size` rows (a short last batch to a power of two: `batch_rows`), so each bucket
    compiles once or a few times. Log-likelihoods as the `hf` backend computes them: the same
    tokens (`tok_encode`, `_encode_pair`, the prefix token for an empty context, rolling windows
    of `max_length`), left-truncated to `max_length`. Generation is greedy with the KV cache,
    cut at the end token and then at the `until` strings."""

    def __init__(
      self, graphdef, params, tokenizer, *, max_length, batch_size, prefix_id, eos_ids,
      template=None, name="nnx-zoo",
    ):  # fmt: skip
      super().__init__()
      self.graphdef, self.params, self.tok = graphdef, params, tokenizer
      self._max_length, self._batch_size = max_length, batch_size
      self._prefix_id, self.eos_ids = prefix_id, tuple(eos_ids)
      self._template, self._name = template, name  # template: a callable giving chat.Template

    # chat templates (lm-eval's --apply_chat_template): rendered as the hf backend renders them,
    # by transformers' own renderer with the tokenizer's special tokens

    @property
    def tokenizer_name(self) -> str:
      return self._name

    def chat_template(self, chat_template=False) -> str:
      return self._template().source if chat_template and self._template else ""

    def apply_chat_template(self, chat_history, add_generation_prompt=True) -> str:
      import jinja2
      from transformers.utils.chat_template_utils import render_jinja_template

      if self._template is None:
        raise UserError("This model has no chat template: run lm-eval without it.")
      template = self._template()

      def render(messages):
        texts, _ = render_jinja_template(
          [messages],
          chat_template=template.source,
          add_generation_prompt=add_generation_prompt,
          continue_final_message=not add_generation_prompt,
          **dict(template.special),
        )
        return texts[0]

      try:
        return render(chat_history)
      except jinja2.exceptions.TemplateError:  # as the hf backend: again without the system turn
        return render([m for m in chat_history if m["role"] != "system"])

    @property
    def max_length(self) -> int:
      return self._max_length

    @property
    def eot_token_id(self):
      return self.tok.eos_id

    @property
    def prefix_token_id(self):
      if self._prefix_id is None:
        raise UserError(
          "The tokenizer has neither a BOS nor an EOS token, which this task needs before an "
          "empty context or a document: use a tokenizer that names one."
        )
      return self._prefix_id

    def tok_encode(self, string, add_special_tokens=None, **kwargs):
      hf = getattr(self.tok, "tok", None)  # a Hugging Face tokenizer: special tokens as hf adds
      if hf is None:
        return self.tok.encode(string).tolist()
      if add_special_tokens is None:  # as the hf backend: no BOS twice
        bos = None if self._prefix_id is None else self.tok.token_text(self._prefix_id)
        add_special_tokens = not lm_utils.has_bos_prefix(string, bos)
      return list(hf.encode(string, add_special_tokens=add_special_tokens).ids)

    # loglikelihood (TemplateLM's: encode the pairs, then score their tokens)

    def _loglikelihood_tokens(self, requests, disable_tqdm=False, **kwargs):
      rows = []
      for _, context, continuation in requests:
        whole = (list(context) + list(continuation))[-(self.max_length + 1) :]
        rows.append((whole[:-1], whole[1:], len(continuation)))
      results = self._score_rows(rows)
      for (key, _, _), answer in zip(requests, results, strict=True):
        if key is not None:
          self.cache_hook.add_partial("loglikelihood", key, answer)
      return results

    def _score_rows(self, rows):
      """(summed log-probability, all greedy) of each (tokens, targets, num scored) row."""
      B = self._batch_size
      order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
      out = [None] * len(rows)
      start = 0
      while start < len(order):
        T = bucket(len(rows[order[start]][0]))
        batch = [order[start]]
        while len(batch) < B and start + len(batch) < len(order):
          i = order[start + len(batch)]
          if bucket(len(rows[i][0])) != T:
            break
          batch.append(i)
        rows_B = batch_rows(len(batch), B)
        tokens_BT = np.zeros((rows_B, T), np.int32)
        targets_BT = np.zeros((rows_B, T), np.int32)
        mask_BT = np.zeros((rows_B, T), bool)
        for b, i in enumerate(batch):
          tokens, targets, scored = rows[i]
          n = len(tokens)
          tokens_BT[b, :n], targets_BT[b, :n] = tokens, targets
          mask_BT[b, n - scored : n] = True
        logp_B, greedy_B = _score(
          self.params, tokens_BT, targets_BT, mask_BT, graphdef=self.graphdef
        )
        logp_B, greedy_B = np.asarray(logp_B), np.asarray(greedy_B)
        for b, i in enumerate(batch):
          out[i] = (float(logp_B[b]), bool(greedy_B[b]))
        start += len(batch)
      return out

    def loglikelihood_rolling(self, requests, disable_tqdm=False):
      rows, owner = [], []
      for r, (string,) in enumerate(req.args for req in requests):
        windows = get_rolling_token_windows(
          token_list=self.tok_encode(string),
          prefix_token=self.prefix_token_id,
          max_seq_len=self.max_length,
          context_len=1,
        )
        for context, continuation in map(make_disjoint_window, windows):
          whole = (context + continuation)[-(self.max_length + 1) :]
          rows.append((whole[:-1], whole[1:], len(continuation)))
          owner.append(r)
      totals = [0.0] * len(requests)
      for r, (logp, _) in zip(owner, self._score_rows(rows), strict=True):
        totals[r] += logp
      for req, total in zip(requests, totals, strict=True):
        self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
      return totals

    # generate_until

    def generate_until(self, requests, disable_tqdm=False):
      groups = {}  # requests with the same generation arguments, in order
      for i, req in enumerate(requests):
        context, gen_kwargs = req.args
        groups.setdefault(json.dumps(gen_kwargs, sort_keys=True, default=str), []).append(i)
      out = [None] * len(requests)
      eos_text = None if self.tok.eos_id is None else self.tok.token_text(self.tok.eos_id)
      for indices in groups.values():
        kwargs = lm_utils.normalize_gen_kwargs(requests[indices[0]].args[1], 256)
        if kwargs.get("do_sample") and kwargs.get("temperature", 0.0) > 0:
          raise UserError(
            "The task samples (do_sample with a temperature): `zoo lm-eval` decodes greedily; "
            "set do_sample: false in the task's generation_kwargs."
          )
        until = lm_utils.handle_stop_sequences(kwargs.get("until"), eos=eos_text)
        max_new = int(kwargs["max_gen_toks"])
        max_prompt = self.max_length - max_new
        if max_prompt <= 0:
          raise UserError(
            f"The task generates up to {max_new} tokens, more than the model's context "
            f"({self.max_length})."
          )
        prompts = {i: self.tok_encode(requests[i].args[0])[-max_prompt:] for i in indices}
        for i, text in zip(indices, self._generate([prompts[i] for i in indices], max_new, until),
                           strict=True):  # fmt: skip
          out[i] = text
          self.cache_hook.add_partial("generate_until", requests[i].args, text)
      return out

    def _generate(self, prompts, max_new, until):
      """Greedy continuations of token lists `prompts`, each decoded and cut at `until`: on the
      engine (common/engine.py), batch_size slots, continuously batched; a request stops at an
      end token on the device and at a stop string here, between steps."""
      if not hasattr(self, "_engine"):
        self._engine = engine.Engine(
          (self.graphdef, self.params), slots=self._batch_size, max_len=self.max_length
        )
      greedy = engine.SamplingParams(max_new, temperature=0.0, stop_ids=tuple(self.eos_ids))
      rids = {self._engine.submit(p, greedy, seed=0): i for i, p in enumerate(prompts)}
      got = [[] for _ in prompts]
      while self._engine.busy:
        for o in self._engine.step():
          got[rids[o.rid]] += o.tokens
          if o.finish_reason is None and self._stops(self._cut(got[rids[o.rid]]), until):
            self._engine.cancel(o.rid)
      return [
        lm_utils.postprocess_generated_text(
          self.tok.decode(self._cut(ids)), stop=until, think_end_token=None
        )
        for ids in got
      ]

    def _cut(self, ids) -> list[int]:
      """`ids` up to (without) the first end token: hf's generate stops a row there."""
      ids = [int(i) for i in ids]
      ends = [ids.index(e) for e in self.eos_ids if e in ids]
      return ids[: min(ends)] if ends else ids

    def _stops(self, ids, until) -> bool:
      text = self.tok.decode(ids)
      return any(s and s in text for s in until)

  return ZooLM


# --- the command ---


def check_tasks(task_manager, names: list[str]) -> list[str]:
  """`names` as lm-eval knows them (globs expanded); an unknown one is a UserError naming the
  closest known names."""
  known = task_manager.all_tasks
  out = []
  for name in names:
    matched = [name] if name in known else task_manager.match_tasks([name])
    if not matched:
      close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
      hint = f"; did you mean {', '.join(close)}?" if close else ""
      raise UserError(
        f"lm-eval has no task {name!r}{hint} (`lm-eval ls tasks` lists them; --include-path DIR "
        "adds a folder of task YAML files)."
      )
    out += [m for m in matched if m not in out]
  return out


def read_config(workdir: str):
  """The workdir's config.json, refusing a model that is not a decoder LM."""
  from nnx_zoo.common import config as config_lib
  from nnx_zoo.common import tasks

  path = os.path.join(workdir, "config.json")
  if not os.path.exists(path):
    raise UserError(
      f"{workdir} has no config.json: give the --workdir of a `zoo run` or `zoo convert hf`."
    )
  with open(path) as f:
    cfg = config_lib.from_json(f.read())
  tasks.decoder_task(cfg, "zoo lm-eval", workdir)
  return cfg


def _max_length(cfg) -> int:
  """The context lm-eval's hf backend gives the model: its HF config's, else the run's rows."""
  source = cfg.source.config.to_dict() if "source" in cfg and "config" in cfg.source else {}
  source = source.get("text_config") or source
  for key in ("n_positions", "max_position_embeddings", "n_ctx"):
    if source.get(key):
      return int(source[key])
  seq_len = cfg.get("data", {}).get("seq_len", 0)
  return int(seq_len) if seq_len else DEFAULT_MAX_LENGTH


def _eos_ids(cfg, workdir: str, tokenizer) -> list[int]:
  """Where generation stops: generation_config.json's end tokens, as hf's generate reads
  them (else the HF config's), else the tokenizer's."""
  from nnx_zoo.common.hub import generation

  ids = generation.end_ids(cfg, workdir)
  if ids is not None:
    return list(ids)
  return [] if tokenizer.eos_id is None else [tokenizer.eos_id]


def load_lm(workdir: str, *, batch_size: int = 16, cfg=None):
  """The workdir's model and tokenizer as an lm-eval `LM`."""
  from nnx_zoo.common.data import tokenizers
  from nnx_zoo.common.hub import weights

  cfg = cfg or read_config(workdir)
  tokenizer = tokenizers.load(cfg.data.tokenizer)
  bos = tokenizers.special_tokens(cfg.data.tokenizer).get("bos_token")
  hf = getattr(tokenizer, "tok", None)  # a Hugging Face tokenizer's BOS, as hf's prefix token
  bos_id = hf.token_to_id(bos) if hf is not None and bos else None
  from nnx_zoo.common.data import chat

  graphdef, params, _ = weights.restore_params(cfg, workdir)
  return _lm_class()(
    graphdef,
    params,
    tokenizer,
    max_length=_max_length(cfg),
    batch_size=batch_size,
    prefix_id=bos_id if bos_id is not None else tokenizer.eos_id,
    eos_ids=_eos_ids(cfg, workdir, tokenizer),
    template=functools.cache(lambda: chat.template(cfg.data)),  # read if a chat template is asked
    name=os.path.abspath(workdir).replace("/", "__"),
  )


def run(
  workdir: str,
  tasks: list[str],
  *,
  include_path: str | None = None,
  num_fewshot: int | None = None,
  limit: float | None = None,
  batch_size: int = 16,
  output_path: str | None = None,
  apply_chat_template: bool = False,
) -> dict:
  """Evaluates the workdir's model on lm-eval `tasks` (each prompt rendered with the model's chat
  template if `apply_chat_template`, as lm-eval's --apply_chat_template does); prints lm-eval's
  table and writes its results JSON to `output_path` (default WORKDIR/lm_eval/results.json).
  Returns the results."""
  lm_eval = _import_lm_eval()
  from lm_eval.tasks import TaskManager
  from lm_eval.utils import handle_non_serializable, make_table

  if batch_size < 1:
    raise UserError("--batch-size must be at least 1.")
  if include_path is not None and not os.path.isdir(include_path):
    raise UserError(f"--include-path {include_path!r} is not a folder of task YAML files.")
  cfg = read_config(workdir)
  manager = TaskManager(include_path=include_path)
  names = check_tasks(manager, tasks)
  if apply_chat_template:
    from nnx_zoo.common.data import chat

    chat.template(cfg.data)  # a model without a chat template: refused before it is loaded
  lm = load_lm(workdir, batch_size=batch_size, cfg=cfg)
  results = lm_eval.simple_evaluate(
    model=lm,
    tasks=names,
    num_fewshot=num_fewshot,
    limit=limit,
    task_manager=manager,
    log_samples=False,
    apply_chat_template=apply_chat_template,
  )
  results["config"].update(model="nnx-zoo", model_args=f"workdir={os.path.abspath(workdir)}")
  print(make_table(results))
  if "groups" in results:
    print(make_table(results, "groups"))
  output_path = output_path or os.path.join(workdir, "lm_eval", "results.json")
  os.makedirs(os.path.dirname(os.path.abspath(output_path)), exist_ok=True)
  tmp = f"{output_path}.tmp"
  with open(tmp, "w") as f:
    json.dump(results, f, indent=2, default=handle_non_serializable, ensure_ascii=False)
  os.replace(tmp, output_path)
  print(f"# results: {output_path}")
  return results
