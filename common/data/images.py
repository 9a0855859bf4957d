"""Image data: scikit-learn's digits or a user's .npz arrays as grain batches, and captions.

Batches are {"images": [B, H, W, C] float32 in [0, 1], "labels": [B] int32, "weights": [B]
float32} (weight 0: a padding row of the last eval batch), plus, when training with `mix`,
"mix_labels" [B] int32 and "mix" [B] float32 (the share of each image that is another image of
the batch, whose label is its mix label; the loss weighs the two labels by it), plus
"captions": [B] int32 (which of `captions(label)` describes each image) when the iterator is
asked for them, and "text": [B, T] int32 (that caption's tokens, `caption_tokens`) when it is
given them. The training
iterator is a grain DatasetIterator, whose state goes into the checkpoint as the text one's does
(common/data/pipeline.py): a resumed run sees exactly the batches, shifts included, it would have
seen.
"""

import functools
import os
from collections.abc import Callable

import grain
import ml_collections
import numpy as np

from nnx_zoo.common.data import diffusion, kinds, pipeline, sources
from nnx_zoo.common.errors import UserError

KINDS = ("digits", "npz")
AUGMENTS = ("none", "shift", "affine")
MIXES = ("none", "mixup", "cutmix")
DIGITS_HELD_OUT = 360  # the last 360 of the 1,797 digits: indices 1437..1796


def config(**kw) -> ml_collections.ConfigDict:
  """An image data sub-config. kind: "digits" (scikit-learn's 8x8 digits, the last 360 held
  out) or "npz" (.npz files with `images` and `labels`, comma-separated paths or globs);
  augment: "shift" (random shifts of up to max_shift pixels, training only), "affine" (also
  rotated by up to max_rotate degrees and scaled by up to 1 +- max_scale, the shift fractional,
  bilinear) or "none"; augment_prob: the share of training images augmented (each drawn anew:
  the rest enter as they are);
  mix: "mixup" (each training image blended with another of its batch, the other's share drawn
  from Beta(mix_alpha, mix_alpha)), "cutmix" (a box of that share of the area pasted from the
  other) or "none"; mix_prob: the share of training images mixed (the labels weighed by the
  shares, `mix_batch`);
  caption_len > 0: each training image paired with one of its digit's captions, as that many
  byte tokens (`caption_tokens`; CLIP), 0: images and labels only."""
  cfg = {
    "kind": "digits",
    "train_files": "",
    "eval_files": "",  # "": no eval split (kind "files")
    "augment": "shift",
    "max_shift": 1,
    "max_rotate": 15.0,  # augment="affine" only
    "max_scale": 0.1,  # augment="affine" only
    "augment_prob": 1.0,  # < 1: only this share of training images is augmented
    "mix": "none",
    "mix_alpha": 1.0,
    "mix_prob": 1.0,  # < 1: only this share of training images is mixed
    "caption_len": 0,
  }
  unknown = set(kw) - set(cfg)
  if unknown:
    raise UserError(f"Unknown image data keys {sorted(unknown)}; known: {sorted(cfg)}.")
  cfg.update(kw)
  return ml_collections.ConfigDict(cfg)


# Sources


class Images:
  """A grain random-access source over images [N, H, W, C] and labels [N]."""

  def __init__(self, images: np.ndarray, labels: np.ndarray, name: str):
    self.images, self.labels, self.name = images, labels, name

  def __len__(self):
    return len(self.images)

  def __getitem__(self, i):
    return {"images": self.images[i], "labels": self.labels[i]}

  def __repr__(self):  # stable: grain keys the iterator state on it
    return f"Images({self.name}, {len(self)})"


def digits() -> tuple[np.ndarray, np.ndarray]:
  """All 1,797 digits: images [N, 8, 8, 1] float32 in [0, 1] (pixel / 16), labels [N] int32."""
  try:
    from sklearn.datasets import load_digits
  except ImportError:
    raise UserError("The digits come with scikit-learn: run `pip install scikit-learn`.") from None
  d = load_digits()
  return (d.images[..., None] / 16.0).astype(np.float32), d.target.astype(np.int32)


def read_npz(path: str) -> tuple[np.ndarray, np.ndarray]:
  """`images` [N, H, W] or [N, H, W, C] (uint8 0..255, or floats in [0, 1]) and `labels` [N]."""
  try:
    with np.load(path) as f:
      missing = [k for k in ("images", "labels") if k not in f]
      if missing:
        raise UserError(f"{path} has no {' or '.join(missing)} array (it has {sorted(f)}).")
      images, labels = f["images"], f["labels"]
  except (OSError, ValueError) as e:  # not a zip / npz file, or a pickled object array
    raise UserError(f"{path} is not an .npz file of arrays ({e}).") from None
  if images.ndim == 3:
    images = images[..., None]
  if images.ndim != 4 or labels.shape != (len(images),):
    raise UserError(
      f"{path}: images must be [N, H, W] or [N, H, W, C] and labels [N]; got "
      f"{images.shape} and {labels.shape}."
    )
  if not np.issubdtype(labels.dtype, np.integer) or (labels < 0).any():
    raise UserError(f"{path}: labels must be class indices (integers >= 0).")
  if images.dtype == np.uint8:
    images = images / 255.0
  elif not np.issubdtype(images.dtype, np.floating):
    raise UserError(
      f"{path}: images must be uint8 (0..255) or floats in [0, 1], not {images.dtype}."
    )
  elif images.size and (images.min() < 0 or images.max() > 1):
    raise UserError(
      f"{path}: float images must lie in [0, 1] (found {images.min()}..{images.max()}): scale "
      "them, or save them as uint8."
    )
  return images.astype(np.float32), labels.astype(np.int32)


def read_files(patterns: str, key: str) -> tuple[np.ndarray, np.ndarray]:
  files = sources.expand(patterns, key=key)
  parts = [read_npz(f) for f in files]
  shapes = {p[0].shape[1:] for p in parts}
  if len(shapes) > 1:
    raise UserError(f"The files of {key} hold images of different shapes {sorted(shapes)}.")
  return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def load_split(cfg, split: str) -> Images | None:
  """The images of `split` ("train" or "eval"); None when the config has no such split."""
  if cfg.kind == "digits":
    images, labels = digits()
    cut = len(images) - DIGITS_HELD_OUT
    part = slice(cut, None) if split == "eval" else slice(None, cut)
    return Images(images[part], labels[part], f"digits:{split}")
  if cfg.kind == "npz":
    patterns = cfg.train_files if split == "train" else cfg.eval_files
    if split == "eval" and not patterns:
      return None
    images, labels = read_files(patterns, f"data.{split}_files")
    name = ",".join(os.path.basename(f) for f in sources.expand(patterns))
    return Images(images, labels, f"npz:{split}:{name}")
  raise UserError(f"Unknown image data kind {cfg.kind!r}: use one of {KINDS}.")


# Augmentation and iterators


def affine(image_HWC: np.ndarray, *, angle: float, scale: float, dy: float, dx: float):
  """The image rotated by `angle` degrees and scaled by `scale` about its centre, then moved dy
  pixels down and dx right; bilinear, what enters the frame is background (0)."""
  from scipy import ndimage

  H, W = image_HWC.shape[:2]
  a = np.deg2rad(angle)
  # affine_transform maps each output pixel o to the input point M @ o + offset: the inverse.
  M = np.array([[np.cos(a), np.sin(a)], [-np.sin(a), np.cos(a)]]) / scale
  centre = np.array([(H - 1) / 2, (W - 1) / 2])
  offset = centre - M @ (centre + np.array([dy, dx]))
  channels = [
    ndimage.affine_transform(image_HWC[..., c], M, offset=offset, order=1, cval=0.0)
    for c in range(image_HWC.shape[-1])
  ]
  return np.clip(np.stack(channels, axis=-1), 0.0, 1.0).astype(image_HWC.dtype)


def mix_batch(batch: dict, rng: np.random.Generator, *, mix: str, alpha: float, prob: float):
  """The batch with each image, with probability `prob`, mixed with the image `rng` pairs it
  with: "mixup" blends the two, the partner's share m ~ Beta(alpha, alpha); "cutmix" pastes the
  partner's pixels in a box of about m of the area at a random place, m then the box's true
  share. Adds "mix_labels" (the partner's label) and "mix" [B] (m; 0: the image as it was)."""
  images_BHWC, labels_B = batch["images"], batch["labels"]
  B, H, W = images_BHWC.shape[:3]
  partner_B = rng.permutation(B)
  share_B = rng.beta(alpha, alpha, size=B) * (rng.uniform(size=B) < prob)
  other_BHWC = images_BHWC[partner_B]
  if mix == "mixup":
    m_B = share_B.reshape(B, 1, 1, 1)
    images_BHWC = (1 - m_B) * images_BHWC + m_B * other_BHWC
  else:  # cutmix
    images_BHWC = images_BHWC.copy()
    for i in np.flatnonzero(share_B):
      h = int(round(H * np.sqrt(share_B[i])))
      w = int(round(W * np.sqrt(share_B[i])))
      y, x = rng.integers(0, H - h + 1), rng.integers(0, W - w + 1)
      images_BHWC[i, y : y + h, x : x + w] = other_BHWC[i, y : y + h, x : x + w]
      share_B[i] = h * w / (H * W)
  return {
    **batch,
    "images": images_BHWC.astype(batch["images"].dtype),
    "mix_labels": labels_B[partner_B],
    "mix": share_B.astype(np.float32),
  }


def shift(image_HWC: np.ndarray, dy: int, dx: int) -> np.ndarray:
  """The image moved dy pixels down and dx right; what leaves the frame is lost, what enters
  is background (0)."""
  H, W = image_HWC.shape[:2]
  out = np.zeros_like(image_HWC)
  out[max(dy, 0) : H + min(dy, 0), max(dx, 0) : W + min(dx, 0)] = image_HWC[
    max(-dy, 0) : H + min(-dy, 0), max(-dx, 0) : W + min(-dx, 0)
  ]
  return out


def train_iterator(
  source: Images,
  *,
  batch_size: int,
  seed: int,
  augment: str = "shift",
  max_shift: int = 1,
  max_rotate: float = 15.0,
  max_scale: float = 0.1,
  augment_prob: float = 1.0,
  mix: str = "none",
  mix_alpha: float = 1.0,
  mix_prob: float = 1.0,
  num_captions: int = 0,
  caption_tokens: np.ndarray | None = None,
  then: Callable | None = None,
  share: slice | None = None,
) -> grain.DatasetIterator:
  """Endless shuffled global batches (reshuffled each epoch), this process's share of each.
  augment="shift" moves each image by up to max_shift pixels each way, "affine" also rotates it
  by up to max_rotate degrees and scales it by up to 1 +- max_scale; augment_prob < 1 leaves
  each image as it is with probability 1 - augment_prob; mix="mixup" or "cutmix" then mixes
  mix_prob of the images of each batch with others of it (`mix_batch`); num_captions > 0 picks
  one caption per image (the "captions" entry, an index into `captions(label)`). Both are drawn
  per position in the stream, so each epoch draws anew and a restored iterator draws the same.
  `caption_tokens` [classes, captions, T] (`caption_tokens(T)`) picks the captions among its
  own (num_captions is its second dim) and adds their tokens (the "text" entry). `then(example,
  rng) -> example`: a last draw from the same stream (a diffusion's forward process,
  common/data/diffusion.py)."""
  if caption_tokens is not None:
    num_captions = caption_tokens.shape[1]
  if augment not in AUGMENTS:
    raise UserError(f"Unknown augment {augment!r}: use one of {AUGMENTS}.")
  if not 0 <= augment_prob <= 1:
    raise UserError(f"data.augment_prob={augment_prob} is not a probability: give one in [0, 1].")
  if mix not in MIXES:
    raise UserError(f"Unknown mix {mix!r}: use one of {MIXES}.")
  if not 0 <= mix_prob <= 1:
    raise UserError(f"data.mix_prob={mix_prob} is not a probability: give one in [0, 1].")
  if mix != "none" and not mix_alpha > 0:
    raise UserError(f"data.mix_alpha={mix_alpha} must be > 0 (Beta(mix_alpha, mix_alpha)).")
  if len(source) < batch_size:
    raise UserError(
      f"The training data has {len(source)} images, fewer than train.batch_size={batch_size}: "
      "give more images or lower the batch size."
    )

  def draw(example, rng: np.random.Generator):
    image = example["images"]
    # Drawn only when some images stay plain, so augment_prob=1 keeps the streams of before.
    augmented = augment_prob == 1 or rng.uniform() < augment_prob
    if augmented and augment == "affine":
      dy, dx = rng.uniform(-max_shift, max_shift, size=2)
      angle, scale = rng.uniform(-max_rotate, max_rotate), 1 + rng.uniform(-max_scale, max_scale)
      image = affine(image, angle=angle, scale=scale, dy=dy, dx=dx)
    if augmented and augment == "shift" and max_shift:
      dy, dx = rng.integers(-max_shift, max_shift + 1, size=2)
      image = shift(image, int(dy), int(dx))
    out = {"images": image, "labels": example["labels"], "weights": np.float32(1.0)}
    if num_captions:
      out["captions"] = np.int32(rng.integers(num_captions))
      if caption_tokens is not None:
        out["text"] = caption_tokens[example["labels"], out["captions"]]
    return out if then is None else then(out, rng)

  draw_batch = None
  if mix != "none":
    draw_batch = functools.partial(mix_batch, mix=mix, alpha=mix_alpha, prob=mix_prob)
  return pipeline.shuffled_batches(
    source, batch_size=batch_size, seed=seed, draw=draw, draw_batch=draw_batch, share=share
  )


def eval_batches(source: Images, *, batch_size: int, max_batches: int = 0, share=None):
  """The held-out images in order, never augmented; the last batch padded with weight-0 rows."""
  arrays = {
    "images": source.images,
    "labels": source.labels,
    "weights": np.ones(len(source), np.float32),
  }
  return pipeline.padded_batches(
    arrays, batch_size=batch_size, max_batches=max_batches, share=share
  )


# Captions (CLIP)

NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
CAPTION_TEMPLATES = (
  "a photo of the number {word}",
  "a handwritten {digit}",
  "a drawing of the digit {word}",
  "the number {word}, written by hand",
  "a small blurry image of a {digit}",
  "a scan of a handwritten {word}",
)
ZERO_SHOT_TEMPLATE = CAPTION_TEMPLATES[0]


def captions(label: int) -> list[str]:
  """Every caption of a digit, one per template: "a photo of the number seven", "a handwritten
  7", ..."""
  if not 0 <= label < len(NUMBER_WORDS):
    raise UserError(f"Digit label {label} is not in 0..9.")
  return [t.format(word=NUMBER_WORDS[label], digit=label) for t in CAPTION_TEMPLATES]


def class_prompts(template: str = ZERO_SHOT_TEMPLATE) -> list[str]:
  """One prompt per class, in label order, for zero-shot classification."""
  return [template.format(word=w, digit=d) for d, w in enumerate(NUMBER_WORDS)]


# Caption tokens: UTF-8 bytes between a start and an end token. The end token is the largest id,
# so a text tower pools at the argmax of a row's ids (as OpenAI's CLIP); padding after it is 0,
# which a causal text tower never lets the end token see.
TEXT_START, TEXT_END = 256, 257
TEXT_VOCAB = 258


def encode_texts(texts: list[str], length: int) -> np.ndarray:
  """[N, length] int32: start, the text's bytes, end, then zeros."""
  out = np.zeros((len(texts), length), np.int32)
  for i, text in enumerate(texts):
    ids = [TEXT_START, *text.encode("utf-8"), TEXT_END]
    if len(ids) > length:
      raise UserError(
        f"The caption {text!r} is {len(ids)} tokens with its start and end, more than "
        f"data.caption_len={length}: raise data.caption_len."
      )
    out[i, : len(ids)] = ids
  return out


def caption_tokens(length: int) -> np.ndarray:
  """Every caption of every digit as tokens: [classes, captions, length] int32."""
  return np.stack([encode_texts(captions(d), length) for d in range(len(NUMBER_WORDS))])


# The trainer's data kinds (common/data/kinds.py)


def load(cfg, *, train: bool, batch_size: int, share: slice | None) -> kinds.Data:
  """Augmented (or mixed) training images, the held-out ones; noised for a denoiser (an
  experiment with a `diffusion` section), paired with captions for CLIP (data.caption_len)."""
  held_out = load_split(cfg.data, "eval")
  length = cfg.data.caption_len  # > 0: image-caption pairs (CLIP)
  iterator, then, batches = None, None, eval_batches
  if cfg.get("diffusion") is not None:  # a denoiser: the forward process drawn with the data
    num_classes = cfg.model.conditioning.num_classes
    then = functools.partial(diffusion.noise_example, cfg=cfg.diffusion, num_classes=num_classes)
    batches = diffusion.eval_batches(cfg.diffusion, num_classes, eval_batches)
  if train:
    # Refused here rather than in a check: only training mixes, so `zoo eval` reads such a
    # config as it always has.
    if cfg.data.mix != "none" and (then is not None or length):
      raise UserError(
        f"data.mix={cfg.data.mix!r} mixes a classifier's labels; this task (a denoiser or "
        "image-caption pairs) has none to mix: set data.mix='none'."
      )
    iterator = train_iterator(
      load_split(cfg.data, "train"),
      batch_size=batch_size,
      seed=cfg.seed,
      augment=cfg.data.augment,
      max_shift=cfg.data.max_shift,
      max_rotate=cfg.data.max_rotate,
      max_scale=cfg.data.max_scale,
      augment_prob=cfg.data.augment_prob,
      mix=cfg.data.mix,
      mix_alpha=cfg.data.mix_alpha,
      mix_prob=cfg.data.mix_prob,
      caption_tokens=caption_tokens(length) if length else None,
      then=then,
      share=share,
    )
  prompts = encode_texts(class_prompts(), length) if length else None
  return kinds.Data(iterator, held_out, batches, 1, prompts)


for _kind in KINDS:
  kinds.register(kinds.Kind(_kind, load))
