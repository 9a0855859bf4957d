"""The spoken-digits data: deterministic utterances, held-out voices disjoint from training,
espeak-ng synthesis that repeats itself, fits the window and is cached, batches, word error
counting (per string length), the recipe's room for its longest string, and transcripts of
audio longer than the window."""

import shutil

import numpy as np
import pytest

from nnx_zoo.common import experiments
from nnx_zoo.common.data import audio, speech
from nnx_zoo.common.errors import UserError
from nnx_zoo.common.tasks import speech as speech_task

RECIPE = "speech/spoken-digits"

needs_espeak = pytest.mark.skipif(
  shutil.which("espeak-ng") is None, reason="espeak-ng is not installed"
)


def small(tmp_path, **kw):
  return speech.config(
    **{"num_train": 6, "num_eval": 3, "seconds": 2.0, "cache": str(tmp_path), **kw}
  )


def test_utterances_are_deterministic_and_voices_held_out(tmp_path):
  cfg = small(tmp_path, num_train=300)
  a, b = speech.utterances(cfg, "train"), speech.utterances(cfg, "train")
  assert a == b
  assert speech.utterances(speech.config(seed=1, num_train=300), "train") != a
  train, held = set(speech.voices(cfg, "train")), set(speech.voices(cfg, "eval"))
  assert not train & held and len(held) == len(speech.ACCENTS) * (len(speech.VARIANTS) // 5)
  # No variant is heard in both, in any accent.
  variant = lambda voice: voice.split("+")[1]  # noqa: E731
  assert not {variant(v) for v in train} & {variant(v) for v in held}
  assert {u["voice"] for u in speech.utterances(cfg, "eval", 200)} <= held
  for u in a:
    assert 1 <= len(u["digits"]) <= 4 and 130 <= u["speed"] <= 230 and 20 <= u["pitch"] <= 80
    assert u["text"] == " ".join(speech.WORDS[d] for d in u["digits"])


@needs_espeak
def test_synthesis_repeats_itself_and_is_cached(tmp_path):
  cfg = small(tmp_path)
  items, clips = speech.load_audio(cfg, "eval")
  cached = list(tmp_path.iterdir())
  assert len(cached) == 1 and cached[0].name.startswith("eval-3-")
  again = [speech.synthesize(u) for u in items]  # espeak-ng once more, no cache
  for clip, fresh in zip(clips, again, strict=True):
    assert 0.3 < len(clip) / 16_000 < 2.0 and np.abs(clip).max() > 0.05
    np.testing.assert_allclose(clip, fresh, atol=1 / 32767)  # int16 in the cache
  items2, clips2 = speech.load_audio(cfg, "eval")  # from the cache
  assert items2 == items and all(np.array_equal(x, y) for x, y in zip(clips, clips2, strict=True))


@needs_espeak
def test_batches(tmp_path):
  cfg = small(tmp_path)
  train = speech.load_split(cfg, "train")
  batch = next(speech.train_iterator(train, cfg, batch_size=4, seed=0))
  assert batch["inputs"].shape == (4, 200, 80) and batch["inputs"].dtype == np.float32
  assert batch["targets"].shape == (4, 5)
  again = next(speech.train_iterator(train, cfg, batch_size=4, seed=0))
  np.testing.assert_array_equal(batch["inputs"], again["inputs"])  # the same draws
  held = speech.load_split(cfg, "eval")
  (only,) = speech.eval_batches(held, batch_size=4)
  assert only["inputs"].shape == (4, 200, 80) and only["target_segment_ids"][3].sum() == 0
  for row, text in zip(only["targets"][:3], held.texts, strict=True):
    assert speech.decode(row) == text


@needs_espeak
def test_augmented_batches(tmp_path):
  """Speed, formant and tempo perturbation and SpecAugment: the same draws for the same seed,
  other inputs than without them, the same targets; masked frames and bins hold one value."""
  cfg = small(tmp_path)
  aug = small(tmp_path, speed_perturb=(0.85, 1.15), freq_warp=(0.9, 1.1),
              tempo_perturb=(0.85, 1.15), time_masks=2, time_mask_frames=10, freq_masks=2,
              freq_mask_bins=15)  # fmt: skip
  train = speech.load_split(cfg, "train")
  plain = next(speech.train_iterator(train, cfg, batch_size=4, seed=0))
  batch = next(speech.train_iterator(train, aug, batch_size=4, seed=0))
  again = next(speech.train_iterator(train, aug, batch_size=4, seed=0))
  np.testing.assert_array_equal(batch["inputs"], again["inputs"])
  np.testing.assert_array_equal(batch["targets"], plain["targets"])
  assert batch["inputs"].shape == plain["inputs"].shape
  assert not np.allclose(batch["inputs"], plain["inputs"])
  for x in batch["inputs"]:
    bins = np.flatnonzero(np.ptp(x, axis=0) == 0)  # a masked bin is constant over time
    assert 0 < len(bins) <= 30


@needs_espeak
def test_noise_prob_leaves_a_share_of_the_clips_clean(tmp_path):
  """With noise on none of the clips (and no delay, speed or masks) a training clip's inputs
  are the held-out features of its audio; with noise on every clip, none is; with half, some."""
  kw = dict(max_delay=0.0, num_train=8)
  clean = small(tmp_path, noise_prob=0.0, **kw)
  train = speech.load_split(clean, "train")
  features = np.stack([speech.features(clean, c) for c in train.clips])

  def matches(cfg):
    batch = next(speech.train_iterator(train, cfg, batch_size=8, seed=0))
    return [any(np.allclose(x, f) for f in features) for x in batch["inputs"]]

  assert all(matches(clean))
  assert not any(matches(small(tmp_path, noise_prob=1.0, **kw)))
  half = matches(small(tmp_path, noise_prob=0.5, **kw))
  assert any(half) and not all(half)


@needs_espeak
def test_joined_utterances(tmp_path):
  """With join_prob 1 a clip is two utterances joined by a pause where both fit the window and
  max_digits: its targets are the two strings' digits in order, never more than max_digits."""
  cfg = small(tmp_path, num_train=8, seconds=3.0, max_delay=0.0, noise_prob=0.0, join_prob=1.0)
  train = speech.load_split(cfg, "train")
  got = []
  for seed in range(3):
    batch = next(speech.train_iterator(train, cfg, batch_size=8, seed=seed))
    got += [speech.decode(row) for row in batch["targets"]]
  pairs = {f"{a} {b}" for a in train.texts for b in train.texts}
  assert all(g in pairs or g in train.texts for g in got), got
  assert any(g in pairs and g not in train.texts for g in got), got
  assert all(len(g.split()) <= cfg.max_digits for g in got)


def test_word_errors_and_decode():
  assert speech.word_errors("one two three", "one two three") == 0
  assert speech.word_errors("one too three", "one two three") == 1  # a substitution
  assert speech.word_errors("one three", "one two three") == 1  # a deletion
  assert speech.word_errors("one two two three", "one two three") == 1  # an insertion
  assert speech.word_errors("", "one two") == 2
  assert speech.decode([3 + 7, 3 + 2, speech.END, 3 + 9]) == "seven two"


@needs_espeak
def test_an_utterance_too_long_for_the_window_is_spoken_faster(tmp_path):
  u = dict(text=" ".join(["seven"] * 7), voice="en-us+m1", speed=130, pitch=50)
  slow = speech.synthesize(u)
  assert speech.speech_seconds(slow) > 2.5
  clip, speed = speech.fit(u, 2.5, 230)
  assert 130 < speed < 230 and speech.speech_seconds(clip) <= 2.5
  np.testing.assert_array_equal(clip, speech.synthesize({**u, "speed": speed}))
  assert speech.fit({**u, "text": "seven"}, 2.5, 230)[1] == 130  # one that fits stays


def test_word_error_rate_per_length(monkeypatch, tmp_path):
  """`wer` over every word, `wer_len{n}` over the strings of n digits."""
  held = speech.Split.__new__(speech.Split)
  held.texts = ["one", "two three", "four five", "six"]
  held.items = [{"text": t} for t in held.texts]
  held.features = np.zeros((4, 1, 1), np.float32)
  wrong = {"two three": "two two", "six": ""}
  monkeypatch.setattr(
    speech, "transcribe", lambda _, feats, max_words: [wrong.get(t, t) for t in held.texts]
  )
  got = speech.word_error_rate(None, held, small(tmp_path))
  assert got == {"wer": 2 / 6, "words": 6, "wer_len1": 1 / 2, "wer_len2": 1 / 4}


@needs_espeak
@pytest.mark.slow
def test_recipe_expresses_its_longest_string(tmp_path):
  """The recipe's decoder, targets and decoding hold max_digits words and the end token, and the
  longest string it draws, in its longest word, fits the window at the fastest speed in the
  slowest voices (every variant of the slowest accent, the slowest variant in every accent:
  measured with espeak-ng 1.51); one digit more does not."""
  cfg = experiments.get_config(RECIPE)
  data, n = cfg.data, cfg.data.max_digits
  row, _ = speech.targets([9] * n, speech.target_len(data))
  assert speech.decode(row) == " ".join(["nine"] * n) and row[-1] == speech.END
  assert cfg.model.decoder_position.max_len >= speech.target_len(data)
  speech.check(cfg)
  longer = cfg.copy_and_resolve_references()
  longer.data.max_digits = n + 1
  with pytest.raises(UserError, match="decoder_position.max_len"):
    speech.check(longer)
  # zoo generate's decoder: the start token, then the words and the end token.
  assert cfg.model.decoder_position.max_len - 1 + 1 >= n + 1
  slowest = [f"en-gb-scotland+{v}" for v in speech.VARIANTS]
  slowest += [f"{a}+Marco" for a in speech.ACCENTS]
  said = lambda text, voice: speech.speech_seconds(  # noqa: E731
    speech.synthesize(dict(text=text, voice=voice, speed=data.speed[1], pitch=data.pitch[1]))
  )
  longest = max(said(speech.longest(data), v) for v in slowest)
  assert longest <= data.seconds, longest
  assert said(" ".join(["seven"] * (n + 1)), "en-gb-scotland+Marco") > data.seconds


@needs_espeak
def test_a_clip_longer_than_the_window_transcribes_in_order(tmp_path, capsys):
  """Three held-out utterances of the recipe joined with short pauses, longer than its window,
  through the windowing of `zoo generate --audio` against a stub decoder: it hears a window's
  samples and writes the texts of the utterances whose speech lies whole inside it, and
  "<cut>" for one a cut splits. The transcript is the three texts in order, no warning."""
  data = experiments.get_config(RECIPE).data
  data.cache = str(tmp_path)
  items, clips = speech.load_audio(data, "eval", 3)
  rng = np.random.default_rng(0)
  pause = np.zeros(int(0.2 * audio.SAMPLE_RATE), np.float32)
  parts, spoken, at = [], [], 0
  for clip in clips:
    loud = np.flatnonzero(np.abs(clip) > 1e-3)
    spoken.append((at + loud[0], at + loud[-1] + 1))
    parts += [clip, pause]
    at += len(clip) + len(pause)
  joined = np.concatenate(parts)
  joined += 1e-4 * rng.standard_normal(joined.size, dtype=np.float32)  # a recording's hiss
  assert len(joined) > data.seconds * audio.SAMPLE_RATE
  heard = []

  def stub(samples):
    start = sum(len(w) for w in heard)
    heard.append(samples)
    end = start + len(samples)
    assert len(samples) <= data.seconds * audio.SAMPLE_RATE
    words = []
    for (a, b), u in zip(spoken, items, strict=True):
      if start <= a and b <= end:
        words.append(u["text"])
      elif a < end and start < b:
        words.append("<cut>")
    return " ".join(words), True

  got = speech_task.transcript(joined, seconds=data.seconds, transcribe=stub, limit=8)
  assert got == " ".join(u["text"] for u in items)
  assert len(heard) > 1 and sum(len(w) for w in heard) == len(joined)
  assert "warning" not in capsys.readouterr().err


def test_a_transcript_at_the_length_limit_is_warned_about(capsys):
  """A window whose decoding never wrote its end token is said on stderr, with where it is."""
  clip = np.zeros(int(2.5 * audio.SAMPLE_RATE), np.float32)
  ends = iter([True, False])
  got = speech_task.transcript(clip, seconds=1.5, transcribe=lambda s: ("one", next(ends)), limit=8)
  assert got == "one one"
  err = capsys.readouterr().err
  assert err.count("zoo: warning:") == 1 and "limit of 8 tokens" in err, err
  # Silence is quiet everywhere: the first window ends mid-way through its last half.
  assert "of 1.12-2.50 s" in err, err
