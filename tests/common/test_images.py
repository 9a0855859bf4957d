"""common/data/images.py: the digits split, .npz files, iterators, augmentation, captions."""

import json
import re

import numpy as np
import pytest

from nnx_zoo.common.data import images
from nnx_zoo.common.errors import UserError

load_digits = pytest.importorskip("sklearn.datasets").load_digits


@pytest.fixture(scope="module")
def raw():
  d = load_digits()
  return d.images, d.target


@pytest.fixture(scope="module")
def splits():
  cfg = images.config()
  return images.load_split(cfg, "train"), images.load_split(cfg, "eval")


def take(it, n):
  return [next(it) for _ in range(n)]


def keys(batch_images, batch_labels):
  return [(img.tobytes(), int(y)) for img, y in zip(batch_images, batch_labels, strict=True)]


def test_digits_shapes_ranges_and_values(raw, splits):
  train, held_out = splits
  assert len(train) == 1437 and len(held_out) == 360
  for src in splits:
    assert src.images.dtype == np.float32 and src.images.shape[1:] == (8, 8, 1)
    assert src.labels.dtype == np.int32
    assert src.images.min() == 0.0 and src.images.max() == 1.0
  # pixel / 16 of scikit-learn's own arrays (0..16).
  np.testing.assert_array_equal(train.images[..., 0], (raw[0][:1437] / 16).astype(np.float32))
  np.testing.assert_array_equal(train.labels, raw[1][:1437])
  assert repr(train) == "Images(digits:train, 1437)" and "0x" not in repr(held_out)


def test_held_out_is_exactly_the_last_360(raw, splits):
  _, held_out = splits
  np.testing.assert_array_equal(held_out.images[..., 0], (raw[0][1437:] / 16).astype(np.float32))
  np.testing.assert_array_equal(held_out.labels, raw[1][1437:])


def test_one_training_epoch_is_exactly_the_training_images(splits):
  """Training never sees a held-out image: an epoch of the iterator (no augmentation) is the
  1,437 training images, each once."""
  train, _ = splits
  it = images.train_iterator(train, batch_size=479, seed=0, augment="none")
  seen = []
  for batch in take(it, 3):  # 3 x 479 = 1437
    assert batch["images"].shape == (479, 8, 8, 1) and batch["images"].dtype == np.float32
    assert batch["labels"].dtype == np.int32 and (batch["weights"] == 1).all()
    seen += keys(batch["images"], batch["labels"])
  assert sorted(seen) == sorted(keys(train.images, train.labels))


def test_deterministic_and_seeded(splits):
  train, _ = splits
  a = take(images.train_iterator(train, batch_size=16, seed=3), 4)
  b = take(images.train_iterator(train, batch_size=16, seed=3), 4)
  c = take(images.train_iterator(train, batch_size=16, seed=4), 4)
  for x, y in zip(a, b, strict=True):
    for k in x:
      np.testing.assert_array_equal(x[k], y[k])
  assert not np.array_equal(a[0]["labels"], c[0]["labels"])


def test_iterator_state_restores_the_same_batches_and_shifts(splits):
  train, _ = splits
  small = images.Images(train.images[:40], train.labels[:40], "digits:train:40")
  it = images.train_iterator(small, batch_size=16, seed=5, num_captions=6)
  take(it, 2)
  state = json.loads(json.dumps(it.get_state()))  # as a checkpoint stores it
  expected = take(it, 5)  # crosses into later epochs
  resumed = images.train_iterator(small, batch_size=16, seed=5, num_captions=6)
  resumed.set_state(state)
  for want, got in zip(expected, take(resumed, 5), strict=True):
    assert set(got) == {"images", "labels", "weights", "captions"}
    for k in want:
      np.testing.assert_array_equal(got[k], want[k])


def test_shift_augmentation_moves_each_image_by_at_most_max_shift(splits):
  train, _ = splits
  plain = take(images.train_iterator(train, batch_size=64, seed=1, augment="none"), 3)
  moved = take(images.train_iterator(train, batch_size=64, seed=1, augment="shift"), 3)
  offsets = set()
  for p, m in zip(plain, moved, strict=True):
    np.testing.assert_array_equal(p["labels"], m["labels"])  # same order, only shifted
    for x, y in zip(p["images"], m["images"], strict=True):
      # Reference: np.roll with the wrapped-in row / column zeroed.
      match = [
        (dy, dx)
        for dy in (-1, 0, 1)
        for dx in (-1, 0, 1)
        if np.array_equal(y, rolled_without_wrap(x, dy, dx))
      ]
      assert match, "not a shift of at most 1 pixel"
      offsets.update(match)
  assert len(offsets) == 9  # every shift occurs, including none


def test_each_epoch_draws_new_shifts(splits):
  train, _ = splits
  small = images.Images(train.images[:8], np.arange(8, dtype=np.int32), "first-8")  # label = id
  plain = take(images.train_iterator(small, batch_size=8, seed=2, augment="none"), 6)
  moved = take(images.train_iterator(small, batch_size=8, seed=2, augment="shift"), 6)
  shifts_of = {i: [] for i in range(8)}  # per image, its shift in each epoch
  for p, m in zip(plain, moved, strict=True):
    for x, y, i in zip(p["images"], m["images"], p["labels"], strict=True):
      shifts_of[int(i)].append(
        next(
          (dy, dx)
          for dy in (-1, 0, 1)
          for dx in (-1, 0, 1)
          if np.array_equal(y, rolled_without_wrap(x, dy, dx))
        )
      )
  assert all(len(v) == 6 for v in shifts_of.values())
  assert sum(len(set(v)) > 1 for v in shifts_of.values()) >= 6  # not one shift for good


def rolled_without_wrap(x, dy, dx):
  y = np.roll(x, (dy, dx), axis=(0, 1))
  if dy > 0:
    y[:dy] = 0
  if dy < 0:
    y[dy:] = 0
  if dx > 0:
    y[:, :dx] = 0
  if dx < 0:
    y[:, dx:] = 0
  return y


def test_eval_batches_are_the_held_out_images_unaugmented_and_padded(splits):
  _, held_out = splits
  batches = list(images.eval_batches(held_out, batch_size=100))
  assert len(batches) == 4
  last = batches[-1]
  assert last["images"].shape == (100, 8, 8, 1)
  np.testing.assert_array_equal(last["weights"], [1] * 60 + [0] * 40)
  got = np.concatenate([b["images"] for b in batches])[:360]
  np.testing.assert_array_equal(got, held_out.images)  # in order, never shifted
  np.testing.assert_array_equal(
    np.concatenate([b["labels"] for b in batches])[:360], held_out.labels
  )
  assert len(list(images.eval_batches(held_out, batch_size=100, max_batches=2))) == 2


def test_npz_files(tmp_path):
  rng = np.random.default_rng(0)
  a = rng.integers(0, 256, (6, 4, 4, 3), dtype=np.uint8)
  np.savez(tmp_path / "a.npz", images=a, labels=np.arange(6))
  np.savez(tmp_path / "b.npz", images=a[:2] / 255.0, labels=np.array([1, 2]))
  cfg = images.config(kind="npz", train_files=str(tmp_path / "*.npz"))
  train = images.load_split(cfg, "train")
  assert len(train) == 8 and train.images.shape == (8, 4, 4, 3)
  np.testing.assert_allclose(train.images[:6], a / 255.0, rtol=1e-6)
  np.testing.assert_array_equal(train.labels, [0, 1, 2, 3, 4, 5, 1, 2])
  assert images.load_split(cfg, "eval") is None
  assert repr(train) == "Images(npz:train:a.npz,b.npz, 8)"

  np.savez(tmp_path / "gray.npz", images=a[..., 0], labels=np.zeros(6, int))
  gray = images.load_split(
    images.config(kind="npz", train_files=str(tmp_path / "gray.npz")), "train"
  )
  assert gray.images.shape == (6, 4, 4, 1)


@pytest.mark.parametrize(
  ("arrays", "message"),
  [
    ({"pixels": np.zeros((2, 4, 4)), "labels": np.zeros(2, int)}, "no images"),
    ({"images": np.full((2, 4, 4), 3.0), "labels": np.zeros(2, int)}, r"lie in \[0, 1\]"),
    ({"images": np.zeros((2, 4, 4)), "labels": np.zeros(3, int)}, "labels \\[N\\]"),
    ({"images": np.zeros((2, 4, 4)), "labels": np.array([0.5, 1.0])}, "class indices"),
  ],
)
def test_bad_npz_files_are_refused(tmp_path, arrays, message):
  np.savez(tmp_path / "x.npz", **arrays)
  with pytest.raises(UserError, match=message):
    images.load_split(images.config(kind="npz", train_files=str(tmp_path / "x.npz")), "train")


def test_config_and_iterator_errors(splits):
  with pytest.raises(UserError, match="Unknown image data keys"):
    images.config(seq_len=3)
  with pytest.raises(UserError, match="Unknown augment"):
    images.train_iterator(splits[0], batch_size=4, seed=0, augment="flip")
  with pytest.raises(UserError, match="fewer than train.batch_size"):
    images.train_iterator(splits[1], batch_size=512, seed=0)
  with pytest.raises(UserError, match="No data file"):
    images.load_split(images.config(kind="npz", train_files="/nonexistent/*.npz"), "train")


def test_captions_and_zero_shot_prompts():
  assert "a photo of the number seven" in images.captions(7)
  assert "a handwritten 7" in images.captions(7)
  assert len(images.captions(0)) == len(images.CAPTION_TEMPLATES)
  # Each caption names its own digit only (in words or figures).
  for label in range(10):
    for caption in images.captions(label):
      words = re.findall(r"\w+", caption)
      named = [d for d, w in enumerate(images.NUMBER_WORDS) if w in words or str(d) in words]
      assert named == [label], caption
  prompts = images.class_prompts()
  assert prompts[3] == "a photo of the number three" and len(prompts) == 10
  assert images.class_prompts("a handwritten {digit}")[9] == "a handwritten 9"
  with pytest.raises(UserError):
    images.captions(10)


def test_augment_prob_leaves_the_rest_of_the_images_as_they_are(splits):
  """augment_prob=0.5: about half the images of a stream are the plain ones, the others moved,
  in the same order; 0 moves none, 1 (the default) every one."""
  train, _ = splits
  kw = dict(batch_size=64, seed=3, augment="affine")
  plain = take(images.train_iterator(train, **kw | dict(augment="none")), 4)
  every = take(images.train_iterator(train, **kw), 4)
  half = take(images.train_iterator(train, **kw, augment_prob=0.5), 4)
  none = take(images.train_iterator(train, **kw, augment_prob=0.0), 4)
  for p, e, h, n in zip(plain, every, half, none, strict=True):
    np.testing.assert_array_equal(p["labels"], h["labels"])  # same order
    np.testing.assert_array_equal(p["images"], n["images"])
    assert not any(np.array_equal(x, y) for x, y in zip(p["images"], e["images"], strict=True))
  unchanged = [
    np.array_equal(x, y)
    for p, h in zip(plain, half, strict=True)
    for x, y in zip(p["images"], h["images"], strict=True)
  ]
  assert 0.35 < np.mean(unchanged) < 0.65, np.mean(unchanged)
  with pytest.raises(UserError, match="augment_prob=1.5 is not a probability"):
    images.train_iterator(train, **kw, augment_prob=1.5)


@pytest.mark.parametrize("mix", ["mixup", "cutmix"])
def test_mix_blends_images_of_a_batch_and_says_how_much(splits, mix):
  """mix: each mixed image is (1 - m) of itself and m of its partner, the batch's image of
  `mix_labels`' label (cutmix: a box of exactly m of the area from it, the rest its own); the
  order and labels are the plain stream's; mix_prob=0.5 leaves about half unmixed (m = 0); the
  stream is seeded, and a restored iterator mixes the same."""
  train, _ = splits
  kw = dict(batch_size=64, seed=3, augment="none")
  plain = take(images.train_iterator(train, **kw), 3)
  mixed_it = images.train_iterator(train, **kw, mix=mix, mix_alpha=1.0)
  mixed = take(mixed_it, 3)
  for p, m in zip(plain, mixed, strict=True):
    np.testing.assert_array_equal(p["labels"], m["labels"])
    assert m["images"].dtype == np.float32 and m["mix"].dtype == np.float32
    assert (m["mix"] >= 0).all() and (m["mix"] <= 1).all() and (m["mix"] > 0).mean() > 0.9
    for i in range(64):
      own, share = p["images"][i], m["mix"][i]
      # The partner: an image of the plain batch that explains the mixed one.
      fits = []
      for j in np.flatnonzero(p["labels"] == m["mix_labels"][i]):
        other = p["images"][j]
        if mix == "mixup":
          fits.append(np.allclose(m["images"][i], (1 - share) * own + share * other, atol=1e-6))
        else:
          from_other = np.isclose(m["images"][i], other) & ~np.isclose(own, other)
          kept = np.isclose(m["images"][i], own)
          fits.append(bool((from_other | kept).all()) and from_other.sum() <= share * own.size)
      assert any(fits), (i, share)
  again = take(images.train_iterator(train, **kw, mix=mix), 3)
  for a, b in zip(mixed, again, strict=True):
    for k in a:
      np.testing.assert_array_equal(a[k], b[k])
  state = mixed_it.get_state()
  ahead = take(mixed_it, 2)
  mixed_it.set_state(state)
  for a, b in zip(ahead, take(mixed_it, 2), strict=True):
    np.testing.assert_array_equal(a["images"], b["images"])
    np.testing.assert_array_equal(a["mix"], b["mix"])
  half = take(images.train_iterator(train, **kw, mix=mix, mix_prob=0.5), 4)
  unmixed = np.concatenate([h["mix"] == 0 for h in half])
  assert 0.35 < unmixed.mean() < 0.65, unmixed.mean()
  for p, h in zip(plain, half[:3], strict=True):
    keep = h["mix"] == 0
    np.testing.assert_array_equal(p["images"][keep], h["images"][keep])
  with pytest.raises(UserError, match="Unknown mix"):
    images.train_iterator(train, **kw, mix="blend")
  with pytest.raises(UserError, match="mix_prob=2 is not a probability"):
    images.train_iterator(train, **kw, mix=mix, mix_prob=2)


def test_mixed_labels_weigh_the_loss():
  """A mixed row's cross-entropy is (1 - mix) of its label's and mix of its mix label's; mix 0
  is the plain loss; eval batches (no mix keys) are scored as before."""
  import jax.numpy as jnp

  from nnx_zoo.common.tasks import losses

  class Fixed:
    def classify(self, images_BHWC):
      return jnp.log(jnp.array([[0.7, 0.2, 0.1], [0.1, 0.3, 0.6]]))

  batch = {"images": jnp.zeros((2, 2, 2, 1)), "labels": jnp.array([0, 2]), "weights": jnp.ones(2)}
  _, plain_B, _ = losses.classify_rows(Fixed(), batch)
  np.testing.assert_allclose(plain_B, -np.log([0.7, 0.6]), rtol=1e-6)
  mixed = {**batch, "mix_labels": jnp.array([1, 0]), "mix": jnp.array([0.25, 0.0])}
  _, mixed_B, _ = losses.classify_rows(Fixed(), mixed)
  want = [-(0.75 * np.log(0.7) + 0.25 * np.log(0.2)), -np.log(0.6)]
  np.testing.assert_allclose(mixed_B, want, rtol=1e-6)
