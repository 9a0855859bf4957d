"""`zoo generate --audio` with a converted Whisper checkpoint against transformers: a tiny random
WhisperForConditionalGeneration with a generation_config.json (languages, tasks, suppressed
tokens) and a tokenizer.json of Whisper's special tokens is converted by `zoo convert hf`; the
zoo's greedy transcript of a WAV file (token ids and text) equals what transformers' feature
extractor, `generate(language=..., task=...)` and tokenizer make of it."""

import jax
import numpy as np
import pytest

from nnx_zoo.common import cli, engine, hub
from nnx_zoo.common.data import audio
from nnx_zoo.common.errors import UserError
from nnx_zoo.common.hub import generation
from nnx_zoo.zoo.whisper import params as whisper_params

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

# Whisper's special tokens (their ids below) among words w0, w1, ...; the vocabulary's ids are
# labels of the random weights, so <|endoftext|> takes an id this seed's model writes after a
# few words: the transcript's end is tested too.
SPECIAL = {"<|endoftext|>": 8, "<|nospeech|>": 40, "<|startoftranscript|>": 41, "<|en|>": 42,
           "<|de|>": 43, "<|fr|>": 44, "<|translate|>": 45, "<|transcribe|>": 46,
           "<|startoflm|>": 47, "<|startofprev|>": 48, "<|notimestamps|>": 50}  # fmt: skip
V = 51
WORDS = {f"w{i}": i for i in range(V) if i not in SPECIAL.values()}
ID = {**WORDS, **SPECIAL}
EOS, MAX_NEW = ID["<|endoftext|>"], 12
SECONDS = 1  # the tiny model's window: 50 encoder positions, 100 frames


def hf_model():
  """Weights large against the biases, so the tokens written depend on the audio, the position
  and the prompt (a random model's biases otherwise make it repeat one token)."""
  torch.manual_seed(1)
  config = tf.WhisperConfig(
    vocab_size=V, num_mel_bins=80, d_model=64, encoder_layers=2, decoder_layers=2,
    encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
    decoder_ffn_dim=128, max_source_positions=50 * SECONDS, max_target_positions=24,
    decoder_start_token_id=ID["<|startoftranscript|>"], pad_token_id=ID["<|nospeech|>"],
    bos_token_id=EOS,
    eos_token_id=EOS,
  )  # fmt: skip
  model = tf.WhisperForConditionalGeneration(config).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if p.ndim == 1:
        p.add_(0.05 * torch.randn_like(p))
      elif name == "model.decoder.embed_tokens.weight":
        p.mul_(5.0)
      elif name != "model.encoder.embed_positions.weight":  # the fixed sinusoids
        p.mul_(15.0)
  g = model.generation_config
  g.lang_to_id = {t: ID[t] for t in ("<|en|>", "<|de|>", "<|fr|>")}
  g.task_to_id = {"transcribe": ID["<|transcribe|>"], "translate": ID["<|translate|>"]}
  g.no_timestamps_token_id = ID["<|notimestamps|>"]
  g.is_multilingual = True
  g.forced_decoder_ids = [[1, None], [2, ID["<|transcribe|>"]]]  # as the published configs
  g.suppress_tokens = [ID["w28"]]  # a word the model would write otherwise (checked below)
  g.begin_suppress_tokens = [ID["w9"], EOS]
  return model


def hf_tokenizer():
  """A word-level tokenizer.json whose special tokens have the ids above."""
  vocab = dict(sorted(ID.items(), key=lambda kv: kv[1]))
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token=None))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  tok.add_special_tokens(list(SPECIAL))  # already in the vocabulary: marked special
  assert all(tok.token_to_id(t) == i for t, i in SPECIAL.items())
  return tok


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
  """(transformers' model, its directory, the `zoo convert hf` output, a WAV file)."""
  tmp = tmp_path_factory.mktemp("whisper-generate")
  model = hf_model()
  model.save_pretrained(tmp / "hf")
  hf_tokenizer().save(str(tmp / "hf" / "tokenizer.json"))
  assert cli.main(["convert", "hf", str(tmp / "hf"), "--out", str(tmp / "zoo")]) == 0
  assert (tmp / "zoo" / generation.FILE).is_file()
  t = np.arange(SECONDS * audio.SAMPLE_RATE // 2) / audio.SAMPLE_RATE  # half the window
  audio.write_wav(str(tmp / "a.wav"), 0.3 * np.sin(2 * np.pi * 440 * t) * np.linspace(0, 1, len(t)))
  return model, tmp / "hf", tmp / "zoo", tmp / "a.wav"


def transformers_transcript(model, hf_dir, wav, **prompt) -> tuple[list[int], str]:
  """transformers' own way: feature extractor, generate, tokenizer (special tokens dropped)."""
  extractor = tf.WhisperFeatureExtractor(feature_size=80, chunk_length=SECONDS)
  features = extractor(audio.read_wav(str(wav)), sampling_rate=16_000, return_tensors="pt")
  with torch.no_grad():
    out = model.generate(features.input_features, max_new_tokens=MAX_NEW, **prompt)
  ids = generation.until_eos(out[0].tolist(), (EOS,))  # 5.x returns the new tokens only
  tokenizer = tf.PreTrainedTokenizerFast(tokenizer_file=str(hf_dir / "tokenizer.json"))
  return ids, tokenizer.decode(ids, skip_special_tokens=True)


def zoo_ids(zoo_dir, wav, language=None, task=None) -> list[int]:
  """The token ids `zoo generate --audio` writes, by the functions it calls."""
  model = hub.load(str(zoo_dir))
  settings = generation.settings(
    "whisper", generation.read(str(zoo_dir)), language=language, task=task
  )
  features = audio.log_mel(audio.read_wav(str(wav)), num_mels=80, seconds=SECONDS)
  out = engine.generate_seq2seq(
    model, features[None], max_new_tokens=MAX_NEW, rng=jax.random.key(0), temperature=0.0,
    decoder_prompt=list(settings.decoder_prompt), suppress_ids=settings.suppress_ids,
    begin_suppress_ids=settings.begin_suppress_ids,
  )  # fmt: skip
  return generation.until_eos(np.asarray(out[0]), settings.eos_ids)


def zoo_transcript(capsys, zoo_dir, wav, *flags) -> str:
  capsys.readouterr()
  argv = ["generate", "--workdir", zoo_dir, "--audio", wav, "--max-new-tokens", MAX_NEW, *flags]
  code = cli.main([str(a) for a in argv])
  out, err = capsys.readouterr()
  assert code == 0, err
  return out.rstrip("\n")


def test_transcript_equals_transformers(capsys, converted):
  model, hf_dir, zoo_dir, wav = converted
  results = {}
  for language, task in (("en", "transcribe"), ("de", "translate")):
    want_ids, want_text = transformers_transcript(model, hf_dir, wav, language=language, task=task)
    assert zoo_ids(zoo_dir, wav, language, task) == want_ids, (language, task)
    text = zoo_transcript(capsys, zoo_dir, wav, "--language", language, "--task", task)
    assert text == want_text, (language, task)
    results[language] = want_ids
  # The fixture makes a test: several words, the prompt matters, one transcript ends before
  # MAX_NEW with <|endoftext|>, and without the suppressed tokens transformers writes others.
  assert results["en"] != results["de"]
  assert all(len(ids) >= 3 for ids in results.values()), results
  assert min(len(ids) for ids in results.values()) < MAX_NEW, results
  free, _ = transformers_transcript(
    model, hf_dir, wav, language="en", task="transcribe", suppress_tokens=None,
    begin_suppress_tokens=None,
  )  # fmt: skip
  assert free != results["en"]
  # No flags: English and transcribe (transformers would detect the language instead).
  assert (
    zoo_transcript(capsys, zoo_dir, wav)
    == transformers_transcript(model, hf_dir, wav, language="en", task="transcribe")[1]
  )


def test_long_audio_window_by_window(capsys, converted, tmp_path):
  """Audio longer than the window: the zoo cuts it at its quietest points near each window's end
  (audio.windows) and joins the windows' transcripts; each window's equals what transformers'
  feature extractor, `generate` and tokenizer make of that window's samples. transformers' own
  long-form transcription (timestamp tokens, seeking to the last one) is not what the zoo does.
  A window whose transcript reaches --max-new-tokens without its end is warned about."""
  model, hf_dir, zoo_dir, _ = converted
  t = np.arange(int(0.6 * audio.SAMPLE_RATE)) / audio.SAMPLE_RATE
  pause = np.zeros(int(0.3 * audio.SAMPLE_RATE))
  parts = [0.3 * np.sin(2 * np.pi * hz * t) for hz in (300, 520, 410)]
  clip = np.concatenate([parts[0], pause, parts[1], pause, parts[2]])  # 2.4 s, the window 1 s
  audio.write_wav(str(tmp_path / "long.wav"), clip)
  samples = audio.read_wav(str(tmp_path / "long.wav"))
  spans = audio.windows(samples, seconds=SECONDS)
  assert len(spans) == 3, spans
  want, unended = [], 0
  for i, (start, end) in enumerate(spans):
    audio.write_wav(str(tmp_path / f"w{i}.wav"), samples[start:end])  # the same int16 samples
    ids, text = transformers_transcript(
      model, hf_dir, tmp_path / f"w{i}.wav", language="en", task="transcribe"
    )
    want.append(text)
    unended += len(ids) == MAX_NEW  # no <|endoftext|> within the limit
  assert len(set(want)) == 3, want
  capsys.readouterr()
  argv = ["generate", "--workdir", zoo_dir, "--audio", tmp_path / "long.wav"]
  assert cli.main([str(a) for a in [*argv, "--max-new-tokens", MAX_NEW]]) == 0
  out, err = capsys.readouterr()
  assert out.rstrip("\n") == " ".join(want)
  assert err.count(f"limit of {MAX_NEW} tokens without its end token") == unended, err
  assert cli.main([str(a) for a in [*argv, "--max-new-tokens", 1]]) == 0
  err = capsys.readouterr().err
  assert err.count("limit of 1 tokens without its end token") == 3, err


def test_unknown_language_and_task_refused(capsys, converted):
  _, _, zoo_dir, wav = converted
  capsys.readouterr()
  code = cli.main(["generate", "--workdir", str(zoo_dir), "--audio", str(wav), "--language", "xx"])
  err = capsys.readouterr().err
  assert code == 2 and "Unknown --language 'xx'" in err and "de, en, fr" in err, err
  code = cli.main(["generate", "--workdir", str(zoo_dir), "--audio", str(wav), "--task", "sing"])
  err = capsys.readouterr().err
  assert code == 2 and "transcribe or translate" in err, err


START, EN, DE, TRANSCRIBE, TRANSLATE, NO_TS = 50258, 50259, 50261, 50360, 50359, 50364
MULTILINGUAL = {
  "decoder_start_token_id": START,
  "lang_to_id": {"<|en|>": EN, "<|de|>": DE},
  "task_to_id": {"transcribe": TRANSCRIBE, "translate": TRANSLATE},
  "no_timestamps_token_id": NO_TS,
  "forced_decoder_ids": [[1, None], [2, TRANSCRIBE]],
  "is_multilingual": True,
}


def test_decoder_prompts():
  """The prompts transformers' `_retrieve_init_tokens` writes for short-form audio without
  timestamps, from the generation configs the published checkpoints ship."""
  prompt = whisper_params.decoder_prompt
  assert prompt(MULTILINGUAL, language=None, task=None) == [START, EN, TRANSCRIBE, NO_TS]
  assert prompt(MULTILINGUAL, language="<|de|>", task="translate") == [
    START, DE, TRANSLATE, NO_TS
  ]  # fmt: skip
  # A fine-tuned checkpoint that forces its own language keeps it without flags.
  fine_tuned = {**MULTILINGUAL, "forced_decoder_ids": [[1, DE], [2, TRANSCRIBE]]}
  assert prompt(fine_tuned, language=None, task=None) == [START, DE, TRANSCRIBE, NO_TS]
  # English-only (whisper-tiny.en): no language nor task token.
  english = {"decoder_start_token_id": 50257, "no_timestamps_token_id": 50362,
             "forced_decoder_ids": [[1, 50362]], "is_multilingual": False}  # fmt: skip
  assert prompt(english, language=None, task=None) == [50257, 50362]
  assert prompt(english, language="en", task="transcribe") == [50257, 50362]
  with pytest.raises(UserError, match="English-only"):
    prompt(english, language="de", task=None)
