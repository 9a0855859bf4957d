"""common/tokenizers.py: every kind loads and round-trips; bad files are UserErrors naming them."""

import re

import numpy as np
import pytest

from nnx_zoo.common.data import tokenizers
from nnx_zoo.common.errors import UserError

TEXT = "Hello world: héllo, naïve café, 世界 🙂\nSecond line."

# A small corpus for training tokenizers in the tests: a few hundred words.
CORPUS = [
  "the quick brown fox jumps over the lazy dog",
  "now is the winter of our discontent made glorious summer by this sun of york",
  "to be or not to be that is the question",
  "all the world is a stage and all the men and women merely players",
  "some are born great some achieve greatness and some have greatness thrust upon them",
  "the course of true love never did run smooth",
  "if music be the food of love play on",
  "what is in a name that which we call a rose by any other name would smell as sweet",
] * 8


def test_bytes_round_trip_including_non_ascii():
  tok = tokenizers.load(tokenizers.config("bytes"))
  ids = tok.encode(TEXT)
  assert ids.dtype == np.int32 and len(ids) == len(TEXT.encode("utf-8"))
  assert ids.min() >= 0 and ids.max() < 256
  assert tok.decode(ids) == TEXT
  assert tok.vocab_size == 256 and tok.eos_id is None


def test_gpt2_shipped_files_give_the_known_ids():
  tok = tokenizers.load(tokenizers.config("gpt2"))
  np.testing.assert_array_equal(tok.encode("Hello world"), [15496, 995])
  assert tok.encode("Hello world").dtype == np.int32
  assert tok.decode([15496, 995]) == "Hello world"
  assert tok.decode(tok.encode(TEXT)) == TEXT
  assert tok.eos_id == 50256 and tok.vocab_size == 50257


def test_gpt2_directory_without_bpe_files_is_a_user_error(tmp_path):
  with pytest.raises(UserError, match=re.escape(str(tmp_path))):
    tokenizers.load(tokenizers.config("gpt2", str(tmp_path)))


def test_gpt2_corrupt_files_are_a_user_error(tmp_path):
  (tmp_path / "encoder.json").write_text("{not json", encoding="utf-8")
  (tmp_path / "vocab.bpe").write_text("#version: 0.2\n", encoding="utf-8")
  with pytest.raises(UserError, match=re.escape(str(tmp_path))):
    tokenizers.load(tokenizers.config("gpt2", str(tmp_path)))


def test_hf_tokenizer_json_loads_and_round_trips(tmp_path):
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  hf = Tokenizer(models.BPE())
  hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  hf.decoder = decoders.ByteLevel()
  hf.train_from_iterator(
    CORPUS,
    trainers.BpeTrainer(
      vocab_size=300,
      special_tokens=["<|endoftext|>"],
      show_progress=False,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    ),
  )
  path = tmp_path / "tokenizer.json"
  hf.save(str(path))

  tok = tokenizers.load(tokenizers.config("hf", str(path)))
  assert tok.vocab_size == hf.get_vocab_size()
  assert tok.eos_id == hf.token_to_id("<|endoftext|>")
  ids = tok.encode(CORPUS[2])
  assert ids.dtype == np.int32 and len(ids) < len(CORPUS[2])  # merges learned from the corpus
  assert list(ids) == hf.encode(CORPUS[2]).ids
  assert tok.decode(ids) == CORPUS[2]
  assert tok.decode(tok.encode(TEXT)) == TEXT  # byte-level: nothing is unknown


def test_sentencepiece_model_loads_and_round_trips(tmp_path):
  import sentencepiece

  corpus = tmp_path / "corpus.txt"
  corpus.write_text("\n".join(CORPUS) + "\n", encoding="utf-8")
  sentencepiece.SentencePieceTrainer.train(
    input=str(corpus),
    model_prefix=str(tmp_path / "sp"),
    vocab_size=50,
    model_type="bpe",
    character_coverage=1.0,
    minloglevel=2,
  )
  path = tmp_path / "sp.model"

  tok = tokenizers.load(tokenizers.config("sentencepiece", str(path)))
  assert tok.vocab_size == 50
  assert tok.eos_id == 2  # sentencepiece's default </s>
  text = "to be or not to be that is the question"
  ids = tok.encode(text)
  assert ids.dtype == np.int32 and 0 < len(ids) < len(text)
  assert tok.decode(ids) == text
  assert tok.decode(tok.encode(CORPUS[7])) == CORPUS[7]


@pytest.mark.parametrize("kind", ["hf", "sentencepiece"])
def test_missing_file_is_a_user_error_naming_it(tmp_path, kind):
  path = str(tmp_path / "nope" / "tokenizer.bin")
  with pytest.raises(UserError, match="does not exist") as e:
    tokenizers.load(tokenizers.config(kind, path))
  assert path in str(e.value)


@pytest.mark.parametrize("kind", ["hf", "sentencepiece"])
def test_corrupt_file_is_a_user_error_naming_it(tmp_path, kind):
  path = tmp_path / "corrupt.bin"
  path.write_bytes(b"\x00\x01 this is not a tokenizer \xff" * 10)
  with pytest.raises(UserError, match="does not load") as e:
    tokenizers.load(tokenizers.config(kind, str(path)))
  assert str(path) in str(e.value)


def test_unknown_kind_is_a_user_error():
  with pytest.raises(UserError, match="wordpiece"):
    tokenizers.load(tokenizers.config("wordpiece", "x"))
