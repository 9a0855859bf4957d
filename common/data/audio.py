"""Audio for speech models: WAV files in, Whisper's log-mel features out.

Whisper's features (transformers' `WhisperFeatureExtractor`, OpenAI's `log_mel_spectrogram`):
16 kHz mono audio padded with zeros (or cut) to the window (30 s), a centred STFT (reflect
padding) with a periodic Hann window of 400 samples (25 ms) every 160 (10 ms), the power
spectrum through 80 or 128 Slaney-style mel filters (0-8 kHz), log10 (floored at 1e-10), clamped
to 8 below the maximum, then (x + 4) / 4; the last frame dropped: 100 frames a second, 3000 for
30 s, returned [T, mels] (features last, as the zoo's encoders read them).

The window and resampling come from scipy (`scipy.signal`), the STFT is numpy's rfft over
strided frames. The mel filter bank is written out here (`mel_filters`, ~20 lines) instead of
taken from librosa, whose filters OpenAI's Whisper ships: librosa would bring numba and llvmlite
for one function, and transformers itself computes the same bank with numpy
(`audio_utils.mel_filter_bank`). Both are tested equal to transformers
(tests/common/test_audio.py).
"""

import functools

import numpy as np

from nnx_zoo.common.errors import UserError

SAMPLE_RATE = 16_000
N_FFT = 400  # 25 ms window
HOP = 160  # 10 ms: 100 frames a second
SECONDS = 30  # Whisper's window


def hz_to_mel(hz):
  """Slaney's mel scale: linear below 1 kHz, logarithmic above (librosa's htk=False)."""
  hz = np.asarray(hz, np.float64)
  f_sp, min_log_hz, logstep = 200.0 / 3, 1000.0, np.log(6.4) / 27.0
  mel = hz / f_sp
  log_region = hz >= min_log_hz
  return np.where(
    log_region, min_log_hz / f_sp + np.log(np.maximum(hz, 1e-10) / min_log_hz) / logstep, mel
  )


def mel_to_hz(mel):
  mel = np.asarray(mel, np.float64)
  f_sp, min_log_hz, logstep = 200.0 / 3, 1000.0, np.log(6.4) / 27.0
  min_log_mel = min_log_hz / f_sp
  return np.where(
    mel >= min_log_mel, min_log_hz * np.exp(logstep * (mel - min_log_mel)), f_sp * mel
  )


def mel_filters(
  num_mels: int, *, n_fft: int = N_FFT, sample_rate: int = SAMPLE_RATE, warp: float = 1.0
):
  """[n_fft // 2 + 1, num_mels]: triangular filters evenly spaced on the Slaney mel scale from 0
  to sample_rate / 2, each scaled to unit area (norm="slaney"). `warp` != 1: vocal tract length
  perturbation (Jaitly and Hinton 2013): the power at f Hz is counted at warp x f, so a voice's
  formants move by that factor (what beyond sample_rate / 2 is dropped)."""
  fft_hz = np.linspace(0, sample_rate / 2, n_fft // 2 + 1) * warp
  edges_hz = mel_to_hz(np.linspace(hz_to_mel(0.0), hz_to_mel(sample_rate / 2), num_mels + 2))
  lower, centre, upper = edges_hz[:-2], edges_hz[1:-1], edges_hz[2:]
  rising = (fft_hz[:, None] - lower) / (centre - lower)
  falling = (upper - fft_hz[:, None]) / (upper - centre)
  filters = np.maximum(0.0, np.minimum(rising, falling))
  return filters * (2.0 / (upper - lower))


@functools.lru_cache(maxsize=8)
def _stft_tables(num_mels: int) -> tuple[np.ndarray, np.ndarray]:
  """The periodic Hann window (as torch's hann_window) and the mel filters, float32: built once
  rather than for every clip of an input pipeline."""
  from scipy.signal import get_window

  window = get_window("hann", N_FFT).astype(np.float32)  # periodic: fftbins=True
  return window, mel_filters(num_mels).astype(np.float32)


def log_mel(
  audio: np.ndarray,
  *,
  num_mels: int = 80,
  seconds: float = SECONDS,
  sample_rate=SAMPLE_RATE,
  freq_warp: float = 1.0,
) -> np.ndarray:
  """Whisper's log-mel features [T, num_mels] float32 of mono audio [samples] at 16 kHz,
  padded with zeros or cut to `seconds` (T = 100 * seconds). Computed in float32 (numpy's
  rfft keeps it), as torch computes Whisper's. `freq_warp` != 1: through `mel_filters`'
  warped filters (an augmentation; 1 is Whisper's)."""
  if sample_rate != SAMPLE_RATE:
    raise UserError(f"Log-mel features take {SAMPLE_RATE} Hz audio, not {sample_rate} Hz.")
  audio = np.asarray(audio, np.float32)
  if audio.ndim != 1:
    raise UserError(f"Expected mono audio [samples], got shape {audio.shape}.")
  n = int(round(seconds * SAMPLE_RATE))
  length = min(len(audio), n)
  num_frames = n // HOP  # the last frame dropped, as Whisper does
  # Frames past the audio see only the zero padding (power 0): their log is the floor, so only
  # the frames that touch the audio are transformed (short audio in a 30 s window: most of it).
  busy = min(num_frames, -(-(length + N_FFT // 2) // HOP) + 1)
  if busy > num_frames - 2:  # near the end the reflect padding reaches back into the audio
    busy = num_frames
  # A centred STFT: the window of audio (zeros after it) with numpy's reflect padding of
  # N_FFT // 2 samples either side, written into one float32 buffer.
  half = N_FFT // 2
  window_audio = audio[:n]
  if n > half + 1:
    padded = np.zeros(n + 2 * half, np.float32)
    padded[half : half + length] = window_audio
    padded[:half] = padded[2 * half : half : -1]
    padded[half + n :] = padded[half + n - 2 : n - 2 : -1]
  else:  # a window shorter than the padding: numpy reflects it several times over
    padded = np.pad(np.pad(window_audio, (0, n - length)), half, mode="reflect")
  window, filters = _stft_tables(num_mels)
  if freq_warp != 1.0:
    filters = mel_filters(num_mels, warp=freq_warp).astype(np.float32)
  frames = np.lib.stride_tricks.sliding_window_view(padded, N_FFT)[::HOP][:busy]
  spectrum = np.fft.rfft(frames * window, axis=-1)
  power = spectrum.real**2 + spectrum.imag**2
  log_spec = np.full((num_frames, num_mels), -10.0, np.float32)  # log10 of the 1e-10 floor
  log_spec[:busy] = np.log10(np.maximum(power @ filters, 1e-10))
  log_spec = np.maximum(log_spec, log_spec.max() - 8.0)
  return (log_spec + 4.0) / 4.0


@functools.lru_cache(maxsize=64)
def _resample_filter(up: int, down: int) -> np.ndarray:
  """resample_poly's own low-pass filter for up / down (in lowest terms): a Kaiser-windowed
  (beta 5) sinc of 20 * max(up, down) + 1 taps cut at the lower Nyquist, designed once per
  ratio rather than for every clip (passed back as its `window`, it gives the same output)."""
  from scipy.signal import firwin

  rate = max(up, down)
  return firwin(20 * rate + 1, 1.0 / rate, window=("kaiser", 5.0)).astype(np.float32)


def change_speed(audio: np.ndarray, factor: float, *, steps: int = 100) -> np.ndarray:
  """`audio` played `factor` times as fast: resampled (polyphase, scipy's resample_poly) to
  len / factor samples, so its pitch and formants rise by `factor` as its tempo does, as tape
  played fast (Kaldi's speed perturbation, Ko et al. 2015). The factor is rounded to a ratio of
  whole numbers over `steps` (1.137 -> 114 / 100)."""
  import math

  from scipy.signal import resample_poly

  if factor <= 0:
    raise UserError(f"A speed factor must be positive, not {factor}.")
  down = int(round(factor * steps))
  if down == steps:
    return np.asarray(audio, np.float32)
  g = math.gcd(steps, down)
  up, down = steps // g, down // g
  out = resample_poly(np.asarray(audio, np.float32), up, down, window=_resample_filter(up, down))
  return out.astype(np.float32, copy=False)


def stretch_frames(features_TC: np.ndarray, rate: float) -> np.ndarray:
  """Features [T, C] of the same sound `rate` times as fast, its pitch and formants unchanged
  (tempo perturbation on the frames): frame t is read at t x rate, linearly interpolated, and
  past the last frame the last frame is repeated (a window's trailing silence). A new array."""
  T = features_TC.shape[0]
  at = np.minimum(np.arange(T) * rate, T - 1)
  lo = np.floor(at).astype(np.int64)
  hi = np.minimum(lo + 1, T - 1)
  frac = (at - lo).astype(features_TC.dtype)[:, None]
  return features_TC[lo] * (1 - frac) + features_TC[hi] * frac


def spec_augment(
  features_TC: np.ndarray,
  rng: np.random.Generator,
  *,
  time_masks: int = 2,
  max_time: int = 20,
  freq_masks: int = 2,
  max_freq: int = 10,
) -> np.ndarray:
  """SpecAugment's masks (Park et al. 2019, without time warping) on log-mel features [T, C]:
  `time_masks` runs of 0..max_time frames and `freq_masks` bands of 0..max_freq bins, each
  of a width drawn uniformly and at a uniform place, set to the features' mean. A new array."""
  out = np.array(features_TC, copy=True)
  fill = out.mean()
  for count, most, axis in ((time_masks, max_time, 0), (freq_masks, max_freq, 1)):
    size = out.shape[axis]
    for _ in range(count):
      width = int(rng.integers(0, min(most, size) + 1))
      start = int(rng.integers(0, size - width + 1))
      if axis == 0:
        out[start : start + width] = fill
      else:
        out[:, start : start + width] = fill
  return out


def windows(
  audio: np.ndarray, *, seconds: float, search: float = 0.5, smooth: float = 0.2
) -> list[tuple[int, int]]:
  """Spans [start, end) of samples that cover `audio` in order, each at most `seconds` long, for
  a model that hears one window at a time. Where the rest of the audio runs past the window, the
  span ends at the quietest point of the window's last `search` share: the lowest mean power
  over `smooth` s around it, within 3 dB (a pause between words is longer than the gaps inside
  one, so a word is not cut in two), in the middle of the latest such stretch."""
  audio = np.asarray(audio, np.float32)
  size = int(round(seconds * SAMPLE_RATE))
  if size < HOP:
    raise UserError(f"A window of {seconds} s is shorter than one frame.")
  energy = np.concatenate([[0.0], np.cumsum(np.square(audio, dtype=np.float64))])
  half = int(smooth * SAMPLE_RATE) // 2
  spans, start = [], 0
  while len(audio) - start > size:
    # Candidate cuts on the frames' 10 ms grid, from the search region's start to the window's end.
    at = np.arange(start + size - int(search * size), start + size + 1, HOP)
    at = at[at > start]
    lo, hi = np.maximum(at - half, 0), np.minimum(at + half, len(audio))
    power = (energy[hi] - energy[lo]) / np.maximum(hi - lo, 1)
    # As quiet as the quietest within 3 dB: a pause's background noise varies that little.
    quiet = np.flatnonzero(power <= 2 * power.min() + 1e-20)
    breaks = np.flatnonzero(np.diff(quiet) > 1)
    first = quiet[breaks[-1] + 1] if len(breaks) else quiet[0]  # where the latest run begins
    cut = int(at[(first + quiet[-1]) // 2])
    spans.append((start, cut))
    start = cut
  spans.append((start, len(audio)))
  return spans


def read_wav(path: str, *, sample_rate: int = SAMPLE_RATE, max_seconds: float | None = None):
  """Mono float32 samples in [-1, 1] of a WAV file at `sample_rate`: other rates are resampled
  (polyphase, scipy's resample_poly), several channels averaged. A file longer than
  `max_seconds` is refused."""
  import math

  from scipy.io import wavfile
  from scipy.signal import resample_poly

  try:
    rate, data = wavfile.read(path)
  except (OSError, ValueError) as e:
    raise UserError(f"Cannot read {path} as a WAV file ({e}).") from None
  if np.issubdtype(data.dtype, np.integer):
    info = np.iinfo(data.dtype)
    # 8-bit WAV is unsigned (centred on 128); wider ones are signed.
    data = (
      (data.astype(np.float64) - (info.max + 1) / 2 * (info.min == 0))
      / (info.max + 1)
      * (2 if info.min == 0 else 1)
    )
  data = data.astype(np.float64)
  if data.ndim == 2:
    data = data.mean(axis=1)
  if rate != sample_rate:
    g = math.gcd(rate, sample_rate)
    data = resample_poly(data, sample_rate // g, rate // g)
  if max_seconds is not None and len(data) > max_seconds * sample_rate + 1:
    raise UserError(
      f"{path} is {len(data) / sample_rate:.1f} s long; the model hears at most {max_seconds:g} s."
    )
  return data.astype(np.float32)


def write_wav(path: str, audio: np.ndarray, *, sample_rate: int = SAMPLE_RATE):
  """16-bit PCM mono WAV."""
  from scipy.io import wavfile

  pcm = np.clip(np.round(np.asarray(audio) * 32768), -32768, 32767).astype(np.int16)
  wavfile.write(path, sample_rate, pcm)
