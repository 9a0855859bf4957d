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
