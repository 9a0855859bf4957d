"""Spoken digit strings synthesised with espeak-ng: ("seven two nine", its audio) pairs, as
log-mel frames and word tokens for a speech recogniser (an encoder-decoder of `frame_inputs`).

The synthesiser is Debian's `espeak-ng` program (1.51; `apt-get install espeak-ng`), run once
per utterance: its voices are an accent (en-us, en-gb, Scottish, RP, ...) and a variant (about
100 of them: male, female, whispered, croaky, klatt, robots...), each at a speed and pitch.
(The PyPI wheel `espeakng-loader` ships the library and its voices but no program, so synthesis
would mean driving libespeak-ng's callback API through ctypes; the Debian package is one
`apt-get` and a subprocess.)

Deterministic: utterance i of a split is drawn from (data.seed, split, i) alone, and espeak-ng
synthesises the same samples for the same arguments. Every utterance's speech fits the window:
one that would run past it is spoken again faster (`fit`), up to the fastest speed of
`data.speed`, at which the window holds `max_digits` digits in every voice (`longest`). The
held-out split is voices training never hears: every `heldout_every`-th variant (in every
accent) is only ever used there. Generated audio is cached as int16 under
~/.cache/nnx-zoo/spoken-digits (`data.cache`), keyed by everything that makes it.
"""

import concurrent.futures
import hashlib
import json
import os
import shutil
import subprocess
import tempfile

import grain
import jax
import ml_collections
import numpy as np
import threadpoolctl

from nnx_zoo.common import files
from nnx_zoo.common.data import audio, kinds, pipeline
from nnx_zoo.common.errors import UserError

KINDS = ("spoken_digits",)
WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
PAD, START, END = 0, 1, 2  # token ids; digit d is 3 + d
VOCAB_SIZE = 3 + len(WORDS)
ACCENTS = ("en-us", "en-gb", "en-gb-scotland", "en-gb-x-rp", "en-gb-x-gbclan", "en-029")
# espeak-ng 1.51's voice variants (`espeak-ng --voices=variant`, their file names), fixed here so
# the split does not depend on what a host has installed.
# fmt: off
VARIANTS = (
  "Alex", "Alicia", "Andrea", "Andy", "Annie", "AnxiousAndy", "Demonic", "Denis", "Diogo", "Gene",
  "Gene2", "Henrique", "Hugo", "Jacky", "Lee", "Marco", "Mario", "Michael", "Mike", "Mr",
  "Nguyen", "RicishayMax", "RicishayMax2", "RicishayMax3", "Storm", "Tweaky", "UniRobot", "adam",
  "anika", "anikaRobot", "announcer", "antonio", "aunty", "belinda", "benjamin", "boris",
  "caleb", "croak", "david", "ed", "edward", "edward2", "f1", "f2", "f3", "f4", "f5", "fast",
  "grandma", "grandpa", "gustave", "iven", "iven2", "iven3", "iven4", "john", "kaukovalta",
  "klatt", "klatt2", "klatt3", "klatt4", "klatt5", "klatt6", "linda", "m1", "m2", "m3", "m4",
  "m5", "m6", "m7", "m8", "marcelo", "max", "michel", "miguel", "norbert", "pablo", "paul",
  "pedro", "quincy", "rob", "robert", "robosoft", "robosoft2", "robosoft3", "robosoft4",
  "robosoft5", "robosoft6", "robosoft7", "robosoft8", "sandro", "shelby", "steph", "steph2",
  "steph3", "travis", "victor", "whisper", "whisperf", "zac",
)
# fmt: on


def config(**kw) -> ml_collections.ConfigDict:
  """The spoken-digits data: `num_train` / `num_eval` utterances of min_digits..max_digits
  digits, each by a voice (accent + variant) at a speed (words a minute) and pitch (0-99) drawn
  uniformly from the ranges (an utterance whose speech would not fit the window is spoken
  faster: `fit`); `heldout_every`: every n-th variant is held out (the eval split's
  voices); `seconds`: the audio window (cut beyond), `mels`: log-mel bins; augmentation of
  training audio, drawn anew each time an utterance is seen: played faster or slower by a factor
  drawn from `speed_perturb` (low, high), pitch and formants moving with it
  (audio.change_speed; (1, 1): off), a random start of up to `max_delay` s, noise at `snr_db`
  (low, high) decibels on a `noise_prob` share of the clips (the rest stay clean: a recogniser
  that only ever heard noise hears clean audio's silences as something else), the log-mels'
  filters warped by a factor drawn from `freq_warp` (vocal tract length perturbation: formants
  move, the tempo does not; audio.mel_filters), the frames played faster or slower by a factor
  drawn from `tempo_perturb` (pitch and formants stay; never slower than the window can hold
  the speech; audio.stretch_frames), then SpecAugment's masks on the log-mels: `time_masks`
  runs of up to `time_mask_frames` frames and `freq_masks` bands of up to `freq_mask_bins` bins
  (audio.spec_augment; 0 masks: off); `join_prob`: the share of training clips that are two
  utterances joined by a pause of `join_pause` (low, high) s, their texts one transcript, where
  both fit the window and max_digits (what `zoo generate --audio` hears in a window of a longer
  recording); `cache`: the directory of generated audio ("" = ~/.cache/nnx-zoo/spoken-digits)."""
  c = dict(
    kind="spoken_digits",
    seed=0,
    num_train=4000,
    num_eval=400,
    min_digits=1,
    max_digits=4,
    speed=(130, 230),
    pitch=(20, 80),
    heldout_every=5,
    seconds=3.0,
    mels=80,
    max_delay=0.3,
    snr_db=(15.0, 40.0),
    noise_prob=1.0,
    speed_perturb=(1.0, 1.0),
    freq_warp=(1.0, 1.0),
    tempo_perturb=(1.0, 1.0),
    time_masks=0,
    time_mask_frames=0,
    freq_masks=0,
    freq_mask_bins=0,
    join_prob=0.0,
    join_pause=(0.1, 0.5),
    cache="",
  )
  unknown = set(kw) - set(c)
  if unknown:
    raise UserError(f"The spoken_digits data has no keys {sorted(unknown)}.")
  c.update(kw)
  return ml_collections.ConfigDict(c)


def voices(cfg, split: str) -> list[str]:
  held = {v for i, v in enumerate(VARIANTS) if i % cfg.heldout_every == cfg.heldout_every - 1}
  variants = [v for v in VARIANTS if (v in held) == (split == "eval")]
  return [f"{a}+{v}" for a in ACCENTS for v in variants]


def utterances(cfg, split: str, count: int | None = None) -> list[dict]:
  """The split's utterances: text, digit ids, voice, speed and pitch of each."""
  count = cfg.num_train if count is None and split == "train" else count or cfg.num_eval
  pool = voices(cfg, split)
  out = []
  for i in range(count):
    rng = np.random.default_rng([cfg.seed, 0 if split == "train" else 1, i])
    digits = rng.integers(0, 10, rng.integers(cfg.min_digits, cfg.max_digits + 1)).tolist()
    out.append(
      dict(
        text=" ".join(WORDS[d] for d in digits),
        digits=digits,
        voice=pool[rng.integers(len(pool))],
        speed=int(rng.integers(cfg.speed[0], cfg.speed[1] + 1)),
        pitch=int(rng.integers(cfg.pitch[0], cfg.pitch[1] + 1)),
      )
    )
  return out


def espeak() -> str:
  path = shutil.which("espeak-ng")
  if path is None:
    raise UserError(
      "The spoken-digits data is synthesised with espeak-ng, which is not installed: "
      "`apt-get install espeak-ng` (Debian, Ubuntu) or your system's package."
    )
  return path


def synthesize(u: dict) -> np.ndarray:
  """One utterance's audio, 16 kHz mono float32."""
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "u.wav")
    cmd = [espeak(), "-v", u["voice"], "-s", str(u["speed"]), "-p", str(u["pitch"]), "-w", path]
    subprocess.run([*cmd, u["text"]], check=True, capture_output=True)
    return audio.read_wav(path)


def speech_seconds(clip: np.ndarray) -> float:
  """Seconds up to the last audible sample: espeak-ng ends every clip with ~0.15 s of silence,
  which a window may cut."""
  loud = np.flatnonzero(np.abs(clip) > 1e-3)
  return (loud[-1] + 1 if len(loud) else 0) / audio.SAMPLE_RATE


def fit(u: dict, seconds: float, fastest: int) -> tuple[np.ndarray, int]:
  """The utterance's audio and speed: spoken at its drawn speed, or, where its speech would run
  past the window, again at the speed that should fit it (never past `fastest`)."""
  clip = synthesize(u)
  speed = u["speed"]
  while speech_seconds(clip) > seconds and speed < fastest:
    # Duration falls as 1 / speed, less espeak-ng's fixed pauses: aim a little faster.
    speed = min(fastest, int(np.ceil(speed * speech_seconds(clip) / seconds * 1.02)))
    clip = synthesize({**u, "speed": speed})
  return clip, speed


def longest(cfg) -> str:
  """The longest string the data draws, in its longest words: max_digits sevens. The window holds
  max_digits digits at the fastest speed when this fits it in the slowest voice (a test checks)."""
  return " ".join(["seven"] * cfg.max_digits)


def _cache_path(cfg, split: str, items: list[dict]) -> str:
  root = cfg.cache or os.path.join(os.path.expanduser("~"), ".cache", "nnx-zoo", "spoken-digits")
  version = subprocess.run([espeak(), "--version"], capture_output=True, text=True).stdout
  made = [version.strip(), items, cfg.seconds, cfg.speed[1]]  # the window and the fastest speed
  key = hashlib.sha1(json.dumps(made).encode()).hexdigest()[:16]
  return os.path.join(root, f"{split}-{len(items)}-{key}.npz")


def load_audio(cfg, split: str, count: int | None = None) -> tuple[list[dict], list[np.ndarray]]:
  """The split's utterances (each with the speed it was spoken at) and their audio, synthesised
  once and then read from the cache."""
  items = utterances(cfg, split, count)
  path = _cache_path(cfg, split, items)
  if os.path.isfile(path):
    with np.load(path) as f:
      samples, ends, speeds = f["samples"], f["ends"], f["speeds"]
  else:
    workers = min(4, os.cpu_count() or 1)
    made = lambda u: fit(u, cfg.seconds, cfg.speed[1])  # noqa: E731
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:  # subprocesses: no GIL held
      clips, speeds = zip(*pool.map(made, items), strict=True)
    ends = np.cumsum([len(c) for c in clips])
    speeds = np.asarray(speeds, np.int32)
    samples = np.clip(np.round(np.concatenate(clips) * 32767), -32768, 32767).astype(np.int16)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with files.replacing(path) as tmp:  # a half-written cache is never read
      np.savez(tmp, samples=samples, ends=ends, speeds=speeds)
  items = [{**u, "speed": int(s)} for u, s in zip(items, speeds, strict=True)]
  starts = np.concatenate([[0], ends[:-1]])
  clips = [samples[a:b].astype(np.float32) / 32767 for a, b in zip(starts, ends, strict=True)]
  return items, clips


def targets(digits: list[int], length: int) -> tuple[np.ndarray, np.ndarray]:
  """The decoder's targets (digit ids then END, padded) and their segment ids."""
  ids = [3 + d for d in digits] + [END]
  row = np.zeros(length, np.int32)
  row[: len(ids)] = ids
  return row, (row != PAD).astype(np.int32)


def decode(ids) -> str:
  """Token ids -> text: the words up to the first END (other ids skipped)."""
  words = []
  for i in np.asarray(ids).tolist():
    if i == END:
      break
    if 3 <= i < VOCAB_SIZE:
      words.append(WORDS[i - 3])
  return " ".join(words)


def word_errors(hypothesis: str, reference: str) -> int:
  """Word-level Levenshtein distance (substitutions, insertions, deletions)."""
  h, r = hypothesis.split(), reference.split()
  prev = list(range(len(h) + 1))
  for i, rw in enumerate(r, 1):
    cur = [i] + [0] * len(h)
    for j, hw in enumerate(h, 1):
      cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (rw != hw))
    prev = cur
  return prev[-1]


def target_len(cfg) -> int:
  return cfg.max_digits + 1


class Split:
  """A split as arrays: features [N, T, mels] (eval) or clips (train), targets, texts."""

  def __init__(self, cfg, split: str, count: int | None = None):
    self.items, self.clips = load_audio(cfg, split, count)
    self.texts = [u["text"] for u in self.items]
    self.spoken = [speech_seconds(c) for c in self.clips]
    rows = [targets(u["digits"], target_len(cfg)) for u in self.items]
    self.targets = np.stack([r[0] for r in rows])
    self.target_segment_ids = np.stack([r[1] for r in rows])
    self.features = None

  def __len__(self):
    return len(self.items)

  def __getitem__(self, i):
    return {"clip": i}

  def __repr__(self):  # grain's iterator state names its source
    return f"speech.Split({len(self)})"


def features(cfg, clip: np.ndarray, *, freq_warp: float = 1.0) -> np.ndarray:
  """The data's log-mel frames of a clip (`freq_warp`: training's formant warp, 1 = none)."""
  return audio.log_mel(clip, num_mels=cfg.mels, seconds=cfg.seconds, freq_warp=freq_warp)


def load_split(cfg, split: str) -> Split:
  out = Split(cfg, split)
  if split == "eval":
    out.features = np.stack([features(cfg, c) for c in out.clips])
  return out


def train_iterator(
  source: Split, cfg, *, batch_size: int, seed: int, share: slice | None = None
) -> grain.DatasetIterator:
  """Endless shuffled batches of augmented training audio (a random speed, delay and noise
  level, then SpecAugment's masks; see `config`), drawn per position in the stream, so a
  restored iterator draws the same."""
  if len(source) < batch_size:
    raise UserError(f"{len(source)} utterances are fewer than train.batch_size={batch_size}.")
  frames = int(round(cfg.seconds * 100))
  # The features' small matrix products (a clip's frames times the mel filters) on one BLAS
  # thread: OpenBLAS's own threads spin against XLA's on a CPU host, which made the pipeline
  # 7x dearer (7 ms a clip against 1 ms) on two shared cores. Process-wide, once.
  threadpoolctl.threadpool_limits(1, user_api="blas")

  def draw(example, rng: np.random.Generator):
    i = example["clip"]
    clip, said = source.clips[i], source.spoken[i]
    target, target_ids = source.targets[i], source.target_segment_ids[i]
    if cfg.join_prob > 0 and rng.uniform() < cfg.join_prob:
      j, pause = int(rng.integers(len(source))), rng.uniform(*cfg.join_pause)
      both = source.items[i]["digits"] + source.items[j]["digits"]
      if len(both) <= cfg.max_digits and said + pause + source.spoken[j] <= cfg.seconds:
        # The first one's speech, the pause, the second one (its leading silence and all).
        gap = np.zeros(int(pause * audio.SAMPLE_RATE), np.float32)
        clip = np.concatenate([clip[: int(said * audio.SAMPLE_RATE)], gap, source.clips[j]])
        said += pause + source.spoken[j]
        target, target_ids = targets(both, len(target))
    # Never slower, nor started later, than the window can hold the speech (long strings come
    # close to filling it): the speed change works in hundredths (audio.change_speed).
    factor = max(rng.uniform(*cfg.speed_perturb), np.ceil(said / cfg.seconds * 100) / 100)
    clip = audio.change_speed(clip, factor)
    power = np.mean(np.square(clip)) + 1e-12
    room = max(0.0, cfg.seconds - said / factor)
    delay = int(rng.uniform(0, min(cfg.max_delay, room)) * audio.SAMPLE_RATE)
    clip = np.concatenate([np.zeros(delay, np.float32), clip])
    if cfg.noise_prob >= 1.0 or rng.uniform() < cfg.noise_prob:
      snr = rng.uniform(*cfg.snr_db)
      clip = clip + rng.standard_normal(len(clip), dtype=np.float32) * np.float32(
        np.sqrt(power / 10 ** (snr / 10))
      )
    warp = rng.uniform(*cfg.freq_warp) if tuple(cfg.freq_warp) != (1.0, 1.0) else 1.0
    inputs = features(cfg, clip, freq_warp=warp)
    if tuple(cfg.tempo_perturb) != (1.0, 1.0):
      # Slower than the window holds would cut the speech off: at least the clip's own rate.
      rate = max(rng.uniform(*cfg.tempo_perturb), len(clip) / audio.HOP / frames)
      inputs = audio.stretch_frames(inputs, rate)
    inputs = audio.spec_augment(
      inputs,
      rng,
      time_masks=cfg.time_masks,
      max_time=cfg.time_mask_frames,
      freq_masks=cfg.freq_masks,
      max_freq=cfg.freq_mask_bins,
    )
    return {
      "inputs": inputs,
      "input_segment_ids": np.ones(frames, np.int32),
      "targets": target,
      "target_segment_ids": target_ids,
    }

  return pipeline.shuffled_batches(source, batch_size=batch_size, seed=seed, draw=draw, share=share)


def eval_batches(source: Split, *, batch_size: int, max_batches: int = 0, share=None):
  """The held-out utterances in order (no augmentation); the last batch padded with rows whose
  targets are all padding (weight 0)."""
  arrays = {
    "inputs": source.features,
    "input_segment_ids": np.ones(source.features.shape[:2], np.int32),
    "targets": source.targets,
    "target_segment_ids": source.target_segment_ids,
  }
  # Padded rows' audio: silence that the encoder sees as one segment; their targets: none.
  pad = {"input_segment_ids": 1}
  return pipeline.padded_batches(
    arrays, batch_size=batch_size, max_batches=max_batches, pad=pad, share=share
  )


def transcribe(model_or_split, features_BTC: np.ndarray, *, max_words: int) -> list[str]:
  """Greedy transcripts of log-mel features [B, T, mels] (the cached decoding)."""
  from nnx_zoo.common import engine

  ids = engine.generate_seq2seq(
    model_or_split,
    features_BTC,
    max_new_tokens=max_words + 1,
    rng=jax.random.key(0),
    temperature=0.0,
  )
  return [decode(row) for row in np.asarray(ids)]


def word_error_rate(model_or_split, source: Split, cfg, *, batch_size: int = 64) -> dict:
  """Greedy transcripts of the held-out split against their texts: WER = word edits / words,
  over the split (`wer`) and over its strings of n digits (`wer_len{n}`)."""
  errors, words = {}, {}
  for start in range(0, len(source), batch_size):
    got = transcribe(
      model_or_split, source.features[start : start + batch_size], max_words=cfg.max_digits
    )
    for hyp, ref in zip(got, source.texts[start : start + batch_size], strict=True):
      n = len(ref.split())
      errors[n] = errors.get(n, 0) + word_errors(hyp, ref)
      words[n] = words.get(n, 0) + n
  total = sum(words.values())
  by_length = {f"wer_len{n}": errors[n] / words[n] for n in sorted(words)}
  return {"wer": sum(errors.values()) / max(total, 1), "words": total, **by_length}


# The trainer's data kind (common/data/kinds.py)


def check(cfg):
  """The model's vocabulary holds the spoken words' ids, and its decoder the longest transcript
  (max_digits words and the end token)."""
  kinds.check_vocab(cfg, VOCAB_SIZE, "The spoken words use {ids} ids")
  need, room = target_len(cfg.data), cfg.model.decoder_position.max_len
  if room < need:
    raise UserError(
      f"data.max_digits={cfg.data.max_digits} makes transcripts of {need} tokens (the words and "
      f"the end), longer than the decoder's {room} positions: set "
      f"model.decoder_position.max_len={need} (whisper.config's max_target_len)."
    )


def load(cfg, *, train: bool, batch_size: int, share: slice | None) -> kinds.Data:
  """Augmented training audio, the held-out utterances, and their word error rate as a
  held-out score."""
  held_out = load_split(cfg.data, "eval")
  iterator = None
  if train:
    iterator = train_iterator(
      load_split(cfg.data, "train"), cfg.data, batch_size=batch_size, seed=cfg.seed, share=share
    )

  def score(graphdef, params):
    return word_error_rate((graphdef, params), held_out, cfg.data)

  return kinds.Data(iterator, held_out, eval_batches, target_len(cfg.data), score=score)


for _kind in KINDS:
  kinds.register(kinds.Kind(_kind, load, check))
