"""diffusion/dit-digits end to end in its smoke form, through the `zoo` command: run, eval (the
samples' class accuracy and novelty, measured as the full recipe is) and generate (.npz files
of the classes asked for); user errors of `zoo generate` on an image model."""

import json

import numpy as np
import pytest

from nnx_zoo.common import cli

SMOKE = "diffusion/dit-digits:smoke"


def zoo(capsys, *argv) -> tuple[int, str, str]:
  capsys.readouterr()
  code = cli.main([str(a) for a in argv])
  out, err = capsys.readouterr()
  return code, out, err


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  path = tmp_path_factory.mktemp("dit") / "run"
  assert cli.main(["run", SMOKE, "--workdir", str(path), "--quiet"]) == 0
  return path


@pytest.mark.slow
def test_eval_measures_the_samples(capsys, workdir):
  code, out, err = zoo(capsys, "eval", SMOKE, "--workdir", workdir)
  assert code == 0, err
  result = json.loads(out.strip().splitlines()[-1])
  assert result["samples"] == 20  # 2 of each of the 10 classes
  for key in ("loss", "sample_accuracy", "novel_fraction", "real_accuracy"):
    assert np.isfinite(result[key]), result
  # The held-out real digits: labelled right by the classifier, and not copies of training ones.
  assert result["real_accuracy"] > 0.9 and result["real_novel_fraction"] > 0.5


@pytest.mark.slow
def test_generate_writes_images_and_labels(capsys, workdir, tmp_path):
  code, _, err = zoo(
    capsys, "generate", "--workdir", workdir, "--labels", "3,3,7", "--out", tmp_path / "a.npz"
  )
  assert code == 0, err
  with np.load(tmp_path / "a.npz") as f:
    assert f["images"].shape == (3, 8, 8, 1) and f["labels"].tolist() == [3, 3, 7]
    assert f["images"].min() >= 0 and f["images"].max() <= 1
  argv = ["generate", "--workdir", workdir, "--num-per-label", 2, "--out", tmp_path / "b.npz"]
  code, _, err = zoo(capsys, *argv, "--guidance", 1.0, "--steps", 3, "--eta", 1.0)
  assert code == 0, err
  with np.load(tmp_path / "b.npz") as f:
    assert f["images"].shape == (20, 8, 8, 1)
    assert f["labels"].tolist() == np.repeat(np.arange(10), 2).tolist()


@pytest.mark.slow
@pytest.mark.parametrize(
  "argv, culprit",
  [
    (["--labels", "3,12", "--out", "x.npz"], "0..9"),
    (["--labels", "3"], "--out"),
    (["--prompt", "ROMEO:"], "--labels"),
    (["--labels", "a,b", "--out", "x.npz"], "class ids"),
  ],
)
def test_generate_user_errors(capsys, workdir, argv, culprit):
  code, _, err = zoo(capsys, "generate", "--workdir", workdir, *argv)
  assert code == 2 and err.startswith("zoo: error:") and culprit in err, err
