"""Whisper's log-mel features against transformers' WhisperFeatureExtractor, and WAV reading
(PCM scaling, resampling to 16 kHz, the length limit)."""

import numpy as np
import pytest

from nnx_zoo.common.data import audio
from nnx_zoo.common.errors import UserError


def chirp(seconds: float, rate: int = 16_000, seed: int = 0) -> np.ndarray:
  rng = np.random.default_rng(seed)
  t = np.arange(int(seconds * rate)) / rate
  return (0.3 * np.sin(2 * np.pi * 440 * t * (1 + t)) + 0.05 * rng.standard_normal(t.size)).astype(
    np.float32
  )


@pytest.mark.parametrize("mels", [80, 128])
def test_mel_filters_equal_transformers(mels):
  audio_utils = pytest.importorskip("transformers.audio_utils")
  want = audio_utils.mel_filter_bank(
    num_frequency_bins=201, num_mel_filters=mels, min_frequency=0.0, max_frequency=8000.0,
    sampling_rate=16_000, norm="slaney", mel_scale="slaney",
  )  # fmt: skip
  np.testing.assert_allclose(audio.mel_filters(mels), want, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize(
  ("mels", "window", "seconds"), [(80, 30, 3.0), (128, 30, 1.5), (80, 4, 5.0)]
)
def test_log_mel_equals_whisper_feature_extractor(mels, window, seconds):
  """30 s windows (padded), and a 4 s one with longer audio (cut)."""
  pytest.importorskip("torch")
  tf = pytest.importorskip("transformers")
  x = chirp(seconds)
  extractor = tf.WhisperFeatureExtractor(feature_size=mels, chunk_length=window)
  want = extractor(x, sampling_rate=16_000, return_tensors="np").input_features[0].T
  got = audio.log_mel(x, num_mels=mels, seconds=window)
  assert got.shape == want.shape == (100 * window, mels)
  # Measured max |diff| 3.6e-6 (80 bins) and 1.5e-5 (128) on values of about +-1: float32 STFTs.
  np.testing.assert_allclose(got, want, atol=5e-5)


def test_read_wav_scales_and_resamples(tmp_path):
  from scipy.io import wavfile

  t = np.arange(44_100) / 44_100
  wavfile.write(
    tmp_path / "a.wav", 44_100, (0.5 * 32767 * np.sin(2 * np.pi * 300 * t)).astype(np.int16)
  )
  got = audio.read_wav(str(tmp_path / "a.wav"))
  want = 0.5 * np.sin(2 * np.pi * 300 * np.arange(16_000) / 16_000)
  assert got.dtype == np.float32 and got.shape == (16_000,)
  np.testing.assert_allclose(got[200:-200], want[200:-200], atol=2e-3)  # the edges ring
  audio.write_wav(str(tmp_path / "b.wav"), want)
  np.testing.assert_allclose(audio.read_wav(str(tmp_path / "b.wav")), want, atol=1e-4)
  with pytest.raises(UserError, match="at most 0.5 s"):
    audio.read_wav(str(tmp_path / "b.wav"), max_seconds=0.5)
  (tmp_path / "c.wav").write_text("not audio")
  with pytest.raises(UserError, match="as a WAV file"):
    audio.read_wav(str(tmp_path / "c.wav"))


@pytest.mark.parametrize("factor", [0.85, 1.0, 1.15])
def test_change_speed_scales_length_and_pitch(factor):
  """A 300 Hz tone played `factor` times as fast: len / factor samples at 300 * factor Hz."""
  rate, seconds = 16_000, 2.0
  x = np.sin(2 * np.pi * 300 * np.arange(int(seconds * rate)) / rate).astype(np.float32)
  got = audio.change_speed(x, factor)
  assert got.dtype == np.float32 and abs(len(got) - len(x) / factor) <= 1
  n = len(got) - 400  # away from the edges, which ring
  spectrum = np.abs(np.fft.rfft(got[200:-200] * np.hanning(n)))
  peak_hz = np.argmax(spectrum) * rate / n
  assert abs(peak_hz - 300 * factor) < 2
  want = np.sin(2 * np.pi * 300 * factor * np.arange(len(got)) / rate)
  np.testing.assert_allclose(got[400:-400], want[400:-400], atol=2e-2)
  if factor != 1.0:  # the cached filter is resample_poly's own (float32 against float64)
    from scipy.signal import resample_poly

    exact = resample_poly(x.astype(np.float64), 100, round(factor * 100))
    np.testing.assert_allclose(got, exact, atol=1e-5)
  with pytest.raises(UserError, match="positive"):
    audio.change_speed(x, 0.0)


def test_spec_augment_masks():
  features = np.random.default_rng(0).standard_normal((300, 80)).astype(np.float32)
  kw = dict(time_masks=2, max_time=10, freq_masks=3, max_freq=15)
  got = audio.spec_augment(features, np.random.default_rng(1), **kw)
  again = audio.spec_augment(features, np.random.default_rng(1), **kw)
  np.testing.assert_array_equal(got, again)  # the masks come from the rng alone
  assert got.shape == features.shape and got.dtype == np.float32
  masked = got != features  # the input is left as it was; masks hold its mean
  np.testing.assert_allclose(got[masked], features.mean(), rtol=1e-6)
  rows = masked.all(axis=1).sum()  # masked frames: all their bins changed
  cols = masked.all(axis=0).sum()  # masked bins: all their frames changed
  assert 0 < rows <= 2 * 10 and 0 < cols <= 3 * 15
  # Every changed cell is in a masked row or column (nothing else touched).
  assert (masked == (masked.all(axis=1)[:, None] | masked.all(axis=0)[None, :])).all()
  # Over many draws the widths cover 0..max and never exceed it.
  widths = set()
  for seed in range(200):
    m = audio.spec_augment(features, np.random.default_rng(seed), time_masks=1, max_time=4,
                           freq_masks=0, max_freq=15) != features  # fmt: skip
    widths.add(int(m.all(axis=1).sum()))
  assert widths == {0, 1, 2, 3, 4}
  off = audio.spec_augment(features, np.random.default_rng(0), time_masks=0, freq_masks=0)
  np.testing.assert_array_equal(off, features)


@pytest.mark.parametrize("warp", [0.9, 1.12])
def test_freq_warp_moves_a_tone_by_the_factor(warp):
  """Vocal tract length perturbation: a tone at f Hz through warped filters lands in the mel bin
  of a tone at warp x f Hz through Whisper's own; warp 1 is the features unchanged."""
  rate = 16_000
  t = np.arange(rate) / rate
  for hz in (400.0, 1000.0, 2500.0):
    tone = np.sin(2 * np.pi * hz * t).astype(np.float32)
    moved = np.sin(2 * np.pi * warp * hz * t).astype(np.float32)
    got = audio.log_mel(tone, seconds=1.0, freq_warp=warp)[20:80].argmax(axis=1)
    want = audio.log_mel(moved, seconds=1.0)[20:80].argmax(axis=1)
    np.testing.assert_array_equal(got, want)
    assert (got != audio.log_mel(tone, seconds=1.0)[20:80].argmax(axis=1)).all()
  np.testing.assert_array_equal(audio.log_mel(tone, seconds=1.0, freq_warp=1.0),
                                audio.log_mel(tone, seconds=1.0))  # fmt: skip


@pytest.mark.parametrize("rate", [0.8, 1.0, 1.25])
def test_stretch_frames_reads_frame_t_at_t_times_rate(rate):
  features = np.random.default_rng(0).standard_normal((50, 4)).astype(np.float32)
  got = audio.stretch_frames(features, rate)
  at = np.arange(50) * rate  # numpy's interp holds the last value past the end, as wanted
  want = np.stack([np.interp(at, np.arange(50), features[:, c]) for c in range(4)], axis=1)
  assert got.shape == features.shape and got.dtype == np.float32
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def bursts(layout: list[tuple[float, float]], *, seed: int = 0) -> np.ndarray:
  """Speech-like audio: (seconds of sound, seconds of pause after it) in turn, the sound tone
  bursts of 0.2 s with 40 ms gaps (the gaps between words), faint noise throughout."""
  rng = np.random.default_rng(seed)
  parts = []
  for sound, pause in layout:
    t = np.arange(int(sound * 16_000)) / 16_000
    on = (t % 0.24) < 0.2
    parts += [0.3 * np.sin(2 * np.pi * 300 * t) * on, np.zeros(int(pause * 16_000))]
  clip = np.concatenate(parts)
  return (clip + 1e-4 * rng.standard_normal(clip.size)).astype(np.float32)


def test_windows_cut_in_the_pauses():
  """Spans cover the audio in order, none longer than the window, each cut in the pause nearest
  the window's end (not in a gap between words), in the middle of it; audio the window holds is
  one span."""
  layout = [(1.0, 0.3), (1.2, 0.4), (1.4, 0.3), (1.3, 0.3), (0.5, 0.0)]
  clip = bursts(layout)
  spans = audio.windows(clip, seconds=3.0)
  assert spans[0][0] == 0 and spans[-1][1] == len(clip)
  assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
  assert all(0 < end - start <= 48_000 for start, end in spans)
  pauses, at = [], 0.0
  for sound, pause in layout:
    pauses.append((at + sound, at + sound + pause))
    at += sound + pause
  cuts = [end / 16_000 for _, end in spans[:-1]]
  # Window 1 (0-3 s) holds the pauses at 1.0-1.3 and 2.5-2.9: the later, in the last half;
  # window 2 (from 2.7 s) the one at 4.3-4.6 (not 5.9-6.2, past its end); window 3, from
  # 4.45 s, holds the rest.
  assert len(cuts) == 2, cuts
  for cut, (lo, hi) in zip(cuts, pauses[1:3], strict=True):
    assert lo + 0.1 <= cut <= hi - 0.1, (cuts, pauses)
  assert audio.windows(clip[:48_000], seconds=3.0) == [(0, 48_000)]
  assert audio.windows(np.zeros(0), seconds=3.0) == [(0, 0)]
  # Without a pause the window is cut where the sound is faintest, never past its end.
  tone = bursts([(7.0, 0.0)])
  assert all(end - start <= 48_000 for start, end in audio.windows(tone, seconds=3.0))
