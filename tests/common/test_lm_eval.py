"""`zoo lm-eval`: the zoo's lm-eval model against lm-eval's own `hf` backend on the same tiny
random Llama (converted with `zoo convert hf`), on three offline tasks in lm_eval_tasks/: a
multiple-choice task, a rolling-perplexity task and a generate_until task."""

import json
import os

import numpy as np
import pytest

pytest.importorskip("lm_eval")

import jax  # noqa: E402

from nnx_zoo.common import cli, engine  # noqa: E402
from nnx_zoo.common import lm_eval as zoo_lm_eval  # noqa: E402
from nnx_zoo.common.errors import UserError  # noqa: E402

TASKS_DIR = os.path.join(os.path.dirname(__file__), "lm_eval_tasks")
TASKS = ["zoo_mc", "zoo_rolling", "zoo_gen"]
MAX_LENGTH = 64  # the model's context: the longest document needs several rolling windows


def _corpus() -> list[str]:
  lines = []
  for name in ("mc.jsonl", "texts.jsonl", "gen.jsonl"):
    with open(os.path.join(TASKS_DIR, name)) as f:
      lines += [" ".join(str(v) for v in json.loads(line).values()) for line in f]
  return lines


def write_hf_llama(out: str, *, chat_template: str | None = None):
  """A tiny random Llama with a byte-level BPE tokenizer that adds BOS, as Llama's does (and a
  chat template in its tokenizer_config.json if given)."""
  import tokenizers
  import torch
  import transformers
  from tokenizers import decoders, models, pre_tokenizers, processors, trainers

  os.makedirs(out)
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=320,
    special_tokens=["<|endoftext|>"],
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False,
  )
  tok.train_from_iterator(_corpus(), trainer)
  tok.post_processor = processors.TemplateProcessing(
    single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)]
  )
  tok.save(os.path.join(out, "tokenizer.json"))
  special = {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}
  if chat_template:
    special["chat_template"] = chat_template
  with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
    json.dump({"tokenizer_class": "PreTrainedTokenizerFast", **special}, f)
  torch.manual_seed(0)
  config = transformers.LlamaConfig(
    vocab_size=tok.get_vocab_size(),
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=MAX_LENGTH,
    initializer_range=0.1,  # sharper logits than the default: no near-ties for argmax
    bos_token_id=0,
    eos_token_id=0,
    tie_word_embeddings=False,
  )
  transformers.LlamaForCausalLM(config).save_pretrained(out)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
  pytest.importorskip("torch")
  from nnx_zoo.common.hub import weights

  root = tmp_path_factory.mktemp("lm_eval")
  hf, zoo = str(root / "hf"), str(root / "zoo")
  write_hf_llama(hf)
  weights.convert_hf(hf, zoo)
  return {"hf": hf, "zoo": zoo}


def _evaluate(model, **kwargs):
  import lm_eval
  from lm_eval.tasks import TaskManager

  with pytest.MonkeyPatch.context() as patch:
    patch.chdir(TASKS_DIR)  # the tasks name their data files relative to it
    return lm_eval.simple_evaluate(
      model=model, tasks=TASKS, task_manager=TaskManager(include_path=TASKS_DIR), **kwargs
    )


@pytest.fixture(scope="module")
def zoo_results(dirs):
  programs = zoo_lm_eval._score._cache_size()
  results = _evaluate(zoo_lm_eval.load_lm(dirs["zoo"], batch_size=4), log_samples=True)
  results["score_programs"] = zoo_lm_eval._score._cache_size() - programs
  return results


@pytest.fixture(scope="module")
def hf_results(dirs):
  model_args = f"pretrained={dirs['hf']},dtype=float32"
  return _evaluate("hf", model_args=model_args, batch_size=4, device="cpu", log_samples=True)


def _responses(results, task):
  return [sample["resps"] for sample in results["samples"][task]]


@pytest.mark.slow
def test_multiple_choice_equals_hf(zoo_results, hf_results):
  assert zoo_results["results"]["zoo_mc"]["acc,none"] == hf_results["results"]["zoo_mc"]["acc,none"]
  assert (
    zoo_results["results"]["zoo_mc"]["acc_norm,none"]
    == hf_results["results"]["zoo_mc"]["acc_norm,none"]
  )
  zoo, hf = _responses(zoo_results, "zoo_mc"), _responses(hf_results, "zoo_mc")
  assert len(zoo) == len(hf) == 8
  for zoo_doc, hf_doc in zip(zoo, hf, strict=True):  # per choice: (log-likelihood, is greedy)
    for [(zoo_ll, zoo_greedy)], [(hf_ll, hf_greedy)] in zip(zoo_doc, hf_doc, strict=True):
      assert zoo_ll == pytest.approx(hf_ll, abs=1e-4)
      assert zoo_greedy == hf_greedy


@pytest.mark.slow
def test_rolling_loglikelihood_equals_hf(dirs, zoo_results, hf_results):
  lm = zoo_lm_eval.load_lm(dirs["zoo"])
  with open(os.path.join(TASKS_DIR, "texts.jsonl")) as f:
    lengths = [len(lm.tok_encode(json.loads(line)["text"])) for line in f]
  assert max(lengths) > MAX_LENGTH > min(lengths)  # several windows, and one
  zoo, hf = _responses(zoo_results, "zoo_rolling"), _responses(hf_results, "zoo_rolling")
  assert len(zoo) == len(hf) == 4
  for [zoo_ll], [hf_ll] in zip(zoo, hf, strict=True):
    assert zoo_ll == pytest.approx(hf_ll, abs=1e-4)
  for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
    want = hf_results["results"]["zoo_rolling"][metric]
    assert zoo_results["results"]["zoo_rolling"][metric] == pytest.approx(want, rel=1e-4)


@pytest.mark.slow
def test_generate_until_equals_hf(zoo_results, hf_results):
  zoo, hf = _responses(zoo_results, "zoo_gen"), _responses(hf_results, "zoo_gen")
  assert len(zoo) == len(hf) == 5
  assert zoo == hf
  assert len({len(text) for [[text]] in zoo}) > 1  # some cut at a stop string, some not
  want = hf_results["results"]["zoo_gen"]["exact_match,none"]
  assert zoo_results["results"]["zoo_gen"]["exact_match,none"] == want


@pytest.mark.slow
def test_a_task_compiles_a_few_programs(zoo_results):
  # 32 choices and 5 rolling windows: a program per length bucket (16 to 64 tokens), and a
  # smaller one for a bucket's last, short batch.
  assert 1 <= zoo_results["score_programs"] <= 8


def test_buckets():
  assert [zoo_lm_eval.batch_rows(n, 16) for n in (1, 2, 3, 5, 16, 40)] == [1, 2, 4, 8, 16, 16]
  assert [zoo_lm_eval.bucket(n) for n in (1, 16, 17, 24, 25, 33, 49, 65, 100)] == [
    16,
    16,
    24,
    24,
    32,
    48,
    64,
    96,
    128,
  ]
  assert [zoo_lm_eval.bucket_below(n) for n in (0, 15, 16, 23, 24, 31, 32, 100)] == [
    0,
    0,
    16,
    16,
    24,
    24,
    32,
    96,
  ]


@pytest.mark.slow
def test_ragged_batch_generation_equals_one_prompt_at_a_time(dirs):
  """Prompts of different lengths in one batch (a prefill all of them fill, then each row fed
  its own prompt): each row's greedy tokens equal engine.generate on that prompt alone."""
  lm = zoo_lm_eval.load_lm(dirs["zoo"], batch_size=4)
  text = " ".join(_corpus())
  prompts = [lm.tok_encode(text[start:])[:n] for start, n in ((0, 40), (7, 19), (30, 27))]
  max_new = 20  # two compiled calls of zoo_lm_eval.DECODE_STEPS
  got = lm._generate(prompts, max_new, until=[])
  for prompt, text in zip(prompts, got, strict=True):
    out = engine.generate(
      (lm.graphdef, lm.params),
      np.asarray(prompt)[None],
      max_new_tokens=max_new,
      rng=jax.random.key(0),
      temperature=0.0,
    )
    assert text == lm.tok.decode(lm._cut(np.asarray(out[0, len(prompt) :])))


@pytest.mark.slow
def test_cli_prints_the_table_and_writes_the_results(dirs, tmp_path, capsys, monkeypatch):
  monkeypatch.chdir(TASKS_DIR)
  out = tmp_path / "results.json"
  argv = ["lm-eval", "--workdir", dirs["zoo"], "--tasks", "zoo_mc,zoo_gen"]
  argv += ["--include-path", TASKS_DIR, "--limit", "3", "--output-path", str(out)]
  assert cli.main(argv) == 0
  printed = capsys.readouterr().out
  assert "|zoo_mc" in printed and "exact_match" in printed and str(out) in printed
  results = json.loads(out.read_text())
  assert results["results"]["zoo_mc"]["sample_len"] == 3
  assert set(results["results"]) == {"zoo_mc", "zoo_gen"}
  assert results["config"]["model"] == "nnx-zoo" and dirs["zoo"] in results["config"]["model_args"]


@pytest.mark.slow
def test_unknown_task_is_one_line_naming_close_ones(dirs, tmp_path, capsys):
  out = tmp_path / "results.json"
  argv = ["lm-eval", "--workdir", dirs["zoo"], "--tasks", "zoo_mc,zoo_mcq"]
  argv += ["--include-path", TASKS_DIR, "--output-path", str(out)]
  assert cli.main(argv) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and "'zoo_mcq'" in err and "zoo_mc" in err
  assert not out.exists() and not os.path.exists(os.path.join(dirs["zoo"], "lm_eval"))


def test_a_workdir_that_is_not_a_decoder_is_refused(tmp_path):
  from nnx_zoo.common import config as config_lib
  from nnx_zoo.common import experiments

  cfg = experiments.get_config("vision/vit-digits:smoke", {})
  (tmp_path / "config.json").write_text(config_lib.to_json(cfg))
  with pytest.raises(UserError, match="decoder LM; .* classifier"):
    zoo_lm_eval.run(str(tmp_path), ["zoo_mc"], include_path=TASKS_DIR)
  with pytest.raises(UserError, match="no config.json"):
    zoo_lm_eval.run(str(tmp_path / "nothing"), ["zoo_mc"], include_path=TASKS_DIR)


def test_without_lm_eval_says_what_to_install(monkeypatch):
  import sys

  monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval raises ImportError
  with pytest.raises(UserError, match=r"pip install nnx-zoo\[lm-eval\]"):
    zoo_lm_eval.run("anywhere", ["zoo_mc"])


# A chat template that writes BOS itself (so no second one is added) and leaves an assistant's
# last turn open when lm-eval continues it.
CHAT_TEMPLATE = (
  "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
  "{% if add_generation_prompt %}assistant:{% endif %}"
)


@pytest.fixture(scope="module")
def chat_dirs(tmp_path_factory):
  pytest.importorskip("torch")
  from nnx_zoo.common.hub import weights

  root = tmp_path_factory.mktemp("lm_eval_chat")
  hf, zoo = str(root / "hf"), str(root / "zoo")
  write_hf_llama(hf, chat_template=CHAT_TEMPLATE)
  weights.convert_hf(hf, zoo)
  return {"hf": hf, "zoo": zoo}


@pytest.mark.slow
def test_apply_chat_template_equals_hf(chat_dirs):
  """lm-eval's --apply_chat_template: the zoo renders each request as the hf backend does (the
  same prompt strings) and scores and generates the same on them."""
  tasks = ["zoo_mc", "zoo_gen"]

  def evaluate(model, **kwargs):
    import lm_eval
    from lm_eval.tasks import TaskManager

    with pytest.MonkeyPatch.context() as patch:
      patch.chdir(TASKS_DIR)
      return lm_eval.simple_evaluate(
        model=model,
        tasks=tasks,
        task_manager=TaskManager(include_path=TASKS_DIR),
        apply_chat_template=True,
        log_samples=True,
        limit=4,
        **kwargs,
      )

  zoo = evaluate(zoo_lm_eval.load_lm(chat_dirs["zoo"], batch_size=4))
  model_args = f"pretrained={chat_dirs['hf']},dtype=float32"
  hf = evaluate("hf", model_args=model_args, batch_size=4, device="cpu")
  for task in tasks:
    zoo_args = [s["arguments"] for s in zoo["samples"][task]]
    assert zoo_args == [s["arguments"] for s in hf["samples"][task]]
    assert "assistant:" in json.dumps(zoo_args)  # the template was applied
  assert _responses(zoo, "zoo_gen") == _responses(hf, "zoo_gen")
  for zoo_doc, hf_doc in zip(_responses(zoo, "zoo_mc"), _responses(hf, "zoo_mc"), strict=True):
    for [(zoo_ll, zoo_greedy)], [(hf_ll, hf_greedy)] in zip(zoo_doc, hf_doc, strict=True):
      assert zoo_ll == pytest.approx(hf_ll, abs=1e-4)
      assert zoo_greedy == hf_greedy


@pytest.mark.slow
def test_apply_chat_template_without_a_template_is_refused(dirs, tmp_path, capsys):
  out = tmp_path / "results.json"
  argv = ["lm-eval", "--workdir", dirs["zoo"], "--tasks", "zoo_mc", "--apply-chat-template"]
  argv += ["--include-path", TASKS_DIR, "--output-path", str(out)]
  assert cli.main(argv) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and "chat template" in err
  assert not out.exists()
