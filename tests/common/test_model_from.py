"""Experiments whose model, tokenizer and chat template come from init_from (`model_from`): how
they resolve, what they refuse (one line, exit 2, nothing written), and `zoo eval` of the base."""

import json
import os
import shutil

import numpy as np
import pytest

from nnx_zoo.common import cli, experiments, models
from nnx_zoo.common.data import chat, tokenizers
from nnx_zoo.common.hub import tiny, weights
from nnx_zoo.common.train import trainer
from nnx_zoo.zoo.llama import model as llama


@pytest.fixture(scope="module")
def tiny_dir():
  return tiny.checkpoint("tiny:llama")


def run_cli(argv, capsys) -> tuple[int, str, str]:
  code = cli.main(argv)
  out, err = capsys.readouterr()
  return code, out, err


def test_tiny_checkpoint_is_a_chatml_llama(tiny_dir):
  assert tiny.checkpoint("tiny:llama") == tiny_dir  # made once, then found
  src = weights.source("tiny:llama")
  assert src.kind == "Hugging Face directory" and src.path == tiny_dir
  assert src.model.to_dict() == llama.config("tiny", vocab_size=320).to_dict()
  tok = tokenizers.load(src.tokenizer)
  assert tok.vocab_size == 320 and tok.token_text(tok.eos_id) == "<|im_end|>"
  template = chat.template(
    experiments.get_config("chat/sft:smoke").data
  )  # the tokenizer directory's own template
  assert template.end_of_turn == "<|im_end|>"
  assert template.render([{"role": "user", "content": "hi"}], add_generation_prompt=True) == (
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
  )


def test_tiny_checkpoint_is_what_transformers_reads(tiny_dir):
  """The tiny directory is a real Hugging Face checkpoint: transformers loads it, and its logits
  are the zoo's."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  hf_model = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
  hf_tok = transformers.AutoTokenizer.from_pretrained(tiny_dir)
  text = "<|im_start|>user\nTo be, or not to be?<|im_end|>\n"
  ids = tokenizers.load(weights.source(tiny_dir).tokenizer).encode(text)
  assert ids.tolist() == hf_tok(text)["input_ids"]
  with torch.no_grad():
    want = hf_model(torch.tensor(ids[None])).logits.numpy()
  got = np.asarray(weights.load(tiny_dir)(ids[None]))
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-4)


def test_model_tokenizer_and_levers_resolve_from_init_from(tiny_dir):
  cfg = experiments.get_config(
    "chat/sft:smoke", {"model.lora.rank": "4", "model.remat": "full", "optim.lr": "1e-3"}
  )
  want = llama.config("tiny", vocab_size=320)
  for key in ("family", "dim", "num_layers", "vocab_size", "attention", "position", "mlp"):
    assert cfg.model[key] == want[key], key
  assert (cfg.model.lora.rank, cfg.model.lora.targets) == (4, "attn.*,mlp.*")  # file, then CLI
  assert cfg.model.remat == "full" and cfg.optim.lr == 1e-3
  assert cfg.data.tokenizer.to_dict() == {"kind": "hf", "path": tiny_dir}
  assert cfg.data.chat_template == ""  # the tokenizer directory's
  # A tokenizer given on the command line is kept.
  given = experiments.get_config("chat/sft:smoke", {"data.tokenizer.kind": "bytes"})
  assert given.data.tokenizer.kind == "bytes"


def test_show_says_where_the_model_came_from(tiny_dir, capsys):
  code, out, _ = run_cli(["show", "chat/sft:smoke"], capsys)
  assert code == 0
  assert f"# model: read from init_from=tiny:llama (Hugging Face directory: {tiny_dir})" in out


def test_a_zoo_run_is_a_source_too(tiny_dir, tmp_path):
  """chat/dpo from a chat/sft run: the run's model (its LoRA merged away), tokenizer and the chat
  template it trained with."""
  workdir = str(tmp_path / "sft")
  cfg = experiments.get_config(
    "chat/sft:smoke",
    {"train.steps": "1", "train.eval_every": "0", "model.lora.rank": "2",
     "data.chat_template": tiny.CHATML + "{# mine #}"},
  )  # fmt: skip
  trainer.train(cfg, workdir, progress=False)
  src = weights.source(workdir)
  assert src.kind == "zoo checkpoint" and src.model.lora.rank == 0
  assert src.tokenizer.to_dict() == {"kind": "hf", "path": tiny_dir}
  assert src.chat_template.endswith("{# mine #}")
  dpo = experiments.get_config("chat/dpo:smoke", {"init_from": workdir})
  assert dpo.model.lora.rank == 0 and dpo.model.num_layers == cfg.model.num_layers
  assert dpo.data.chat_template == src.chat_template


@pytest.mark.parametrize(
  ("overrides", "message"),
  [
    ({"init_from": ""}, "takes its model, tokenizer and chat template from init_from"),
    ({"model.num_layers": "3"}, "model.num_layers is that model's architecture"),
    ({"model.attention.num_heads": "2"}, "model.attention.num_heads is that model's"),
    ({"model.vocab_size": "512"}, "model.vocab_size is that model's architecture"),
  ],
)
def test_refused_before_anything_is_written(overrides, message, tmp_path, capsys):
  workdir = tmp_path / "run"
  argv = ["run", "chat/sft:smoke", "--workdir", str(workdir), "--quiet"]
  argv += [f"--config.{k}={v}" for k, v in overrides.items()]
  code, _, err = run_cli(argv, capsys)
  assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
  assert not workdir.exists()


def _copy(tiny_dir, tmp_path, *, drop=(), config=None) -> str:
  out = tmp_path / "ckpt"
  shutil.copytree(tiny_dir, out)
  for name in drop:
    os.remove(out / name)
  if config is not None:
    path = out / "tokenizer_config.json"
    path.write_text(json.dumps(config(json.loads(path.read_text()))))
  return str(out)


def _no_template(tok_config: dict) -> dict:
  return {k: v for k, v in tok_config.items() if k != "chat_template"}


@pytest.mark.parametrize(
  ("case", "message"),
  [
    ("no tokenizer", "has no tokenizer: copy its tokenizer files"),
    ("no template", "has no chat template"),
    ("tokenizer too large", "but the init_from model's vocabulary has 320"),
  ],
)
def test_bad_checkpoints_are_refused(case, message, tiny_dir, tmp_path, capsys):
  overrides = []
  if case == "no tokenizer":
    ckpt = _copy(tiny_dir, tmp_path, drop=("tokenizer.json", "tokenizer_config.json"))
  elif case == "no template":
    ckpt = _copy(tiny_dir, tmp_path, config=_no_template)
  else:
    ckpt = tiny_dir
    overrides = ["--config.data.tokenizer.kind=gpt2"]  # 50,257 ids
  workdir = tmp_path / "run"
  argv = ["run", "chat/sft:smoke", "--workdir", str(workdir), f"--config.init_from={ckpt}"]
  code, _, err = run_cli([*argv, "--quiet", *overrides], capsys)
  assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
  assert not workdir.exists()


def test_eval_of_the_base_is_the_init_from_weights(tmp_path, capsys):
  """`zoo eval` with no checkpoint in the workdir evaluates init_from: the same numbers as a run
  whose one step changed nothing (lr 0)."""
  base = tmp_path / "base"
  code, out, _ = run_cli(["eval", "chat/sft:smoke", "--workdir", str(base)], capsys)
  assert code == 0
  got = json.loads(out.strip().splitlines()[-1])
  assert got["step"] == 0 and got["weights"] == "init_from"
  still = str(tmp_path / "still")
  cfg = experiments.get_config(
    "chat/sft:smoke", {"train.steps": "1", "optim.lr": "0", "train.eval_every": "1"}
  )
  last = trainer.train(cfg, still, progress=False)
  np.testing.assert_allclose(got["loss"], last["eval_loss"], rtol=1e-6)
  assert models.num_params(cfg.model) == 115_008


def test_a_gguf_file_is_a_source_too(tiny_dir, tmp_path):
  """init_from=FILE.gguf: the model config from the file's metadata, its tokenizer (and chat
  template) written once into the cache as a Hugging Face tokenizer directory."""
  pytest.importorskip("gguf")
  pytest.importorskip("torch")  # transformers' GGUF tokenizer reader imports it
  from nnx_zoo.common import hub

  hub.convert_hf(tiny_dir, str(tmp_path / "zoo"))
  path = str(tmp_path / "tiny.gguf")
  hub.export_gguf(str(tmp_path / "zoo"), path)
  cfg = experiments.get_config("chat/sft:smoke", {"init_from": path})
  src = weights.source(tiny_dir)
  want = {**src.model.to_dict(), "lora": cfg.model.lora.to_dict()}
  assert cfg.model.norm.eps == pytest.approx(want["norm"]["eps"], rel=1e-6)  # float32 in GGUF
  want["norm"]["eps"] = cfg.model.norm.eps
  assert cfg.model.to_dict() == want
  assert weights.source(path).tokenizer.path == cfg.data.tokenizer.path  # the same directory
  text = "<|im_start|>user\nTo be?<|im_end|>\n"
  ours, theirs = (tokenizers.load(t) for t in (src.tokenizer, cfg.data.tokenizer))
  assert ours.encode_chat(text)[0].tolist() == theirs.encode_chat(text)[0].tolist()
  assert chat.template(cfg.data).end_of_turn == "<|im_end|>"


def test_generate_and_chat_take_a_gguf_file(tiny_dir, tmp_path, monkeypatch, capsys):
  """`--workdir FILE.gguf`: the file converted once into the cache, answering as its conversion."""
  pytest.importorskip("gguf")
  pytest.importorskip("torch")  # transformers' GGUF tokenizer reader imports it
  from nnx_zoo.common import hub

  monkeypatch.setenv("NNX_ZOO_CACHE", str(tmp_path / "cache"))
  hub.convert_hf(tiny_dir, str(tmp_path / "zoo"))
  path = str(tmp_path / "tiny.gguf")
  hub.export_gguf(str(tmp_path / "zoo"), path)
  messages = tmp_path / "m.json"
  messages.write_text(json.dumps([{"role": "user", "content": "To be?"}]))
  answers = []
  for workdir in (path, str(tmp_path / "zoo"), path):  # the second .gguf read from the cache
    argv = ["chat", "--workdir", workdir, "--messages", str(messages), "--temperature", "0"]
    code, out, _ = run_cli([*argv, "--max-new-tokens", "6"], capsys)
    assert code == 0
    answers.append(out)
  assert answers[0] == answers[1] == answers[2]
  assert len(os.listdir(tmp_path / "cache" / "gguf-checkpoints")) == 1
  code, out, _ = run_cli(["generate", "--workdir", path, "--prompt", "To be", "--temperature", "0",
                          "--max-new-tokens", "4"], capsys)  # fmt: skip
  assert code == 0 and out.startswith("To be")


def test_chat_turn_by_turn_answers_as_the_whole_conversation_does(tiny_dir, tmp_path, monkeypatch,
                                                                    capsys):  # fmt: skip
  """Line after line on standard input (the weights restored and the sampler readied while the
  first is typed): each reply is `--messages`' greedy answer to the conversation so far. A
  restore that fails in the background is the same one-line error."""
  import io

  from nnx_zoo.common import hub

  hub.convert_hf(tiny_dir, str(tmp_path / "zoo"))
  chat_argv = ["chat", "--workdir", str(tmp_path / "zoo"), "--temperature", "0",
               "--max-new-tokens", "5"]  # fmt: skip
  monkeypatch.setattr("sys.stdin", io.StringIO("To be?\nOr not?\n\n"))
  code, out, _ = run_cli(chat_argv, capsys)
  assert code == 0
  replies = out.splitlines()
  assert len(replies) == 2
  conversation = []
  for line, reply in zip(["To be?", "Or not?"], replies, strict=True):
    conversation.append({"role": "user", "content": line})
    (tmp_path / "m.json").write_text(json.dumps(conversation))
    code, out, _ = run_cli([*chat_argv, "--messages", str(tmp_path / "m.json")], capsys)
    assert code == 0 and out.rstrip("\n") == reply
    conversation.append({"role": "assistant", "content": reply})

  config = json.loads((tmp_path / "zoo" / "config.json").read_text())
  config["model"]["num_layers"] += 1  # not the checkpoint's model
  (tmp_path / "zoo" / "config.json").write_text(json.dumps(config))
  code, _, err = run_cli([*chat_argv, "--messages", str(tmp_path / "m.json")], capsys)
  assert code == 2 and "different model" in err and "Traceback" not in err
