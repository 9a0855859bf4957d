"""common/programs.py: a traced program saved with jax.export and loaded by a later process gives
what tracing it gives (the engine's prefill and decode programs, which `zoo chat` runs, greedy and
sampled), is found again only for the same model, arguments and code, and a damaged file is
traced again."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnx_zoo.common import engine, experiments, models, programs


@pytest.fixture(scope="module")
def model():
  cfg = experiments.get_config("lm/shakespeare-char:smoke").model
  return nnx.split(models.build(cfg, seed=0))


def forget(monkeypatch):
  """A new process: no program in memory (programs' nor the engine's own)."""
  monkeypatch.setattr(programs, "_loaded", {})
  monkeypatch.setattr(engine, "_PROGRAMS", {})


def generate(model, **kw):
  prompt = jnp.asarray([[5, 9, 2, 7]], jnp.int32)
  options = dict(max_new_tokens=6, rng=jax.random.key(3), temperature=0.0) | kw
  return np.asarray(engine.generate(model, prompt, **options))


def test_a_saved_program_gives_what_tracing_gives(model, tmp_path, monkeypatch):
  want_greedy, want_sampled = generate(model), generate(model, temperature=1.0)
  folder = tmp_path / "exported"
  monkeypatch.setattr(programs, "directory", lambda: str(folder))
  forget(monkeypatch)
  np.testing.assert_array_equal(generate(model), want_greedy)  # traced and saved
  # Greedy and sampled rows run the same programs (a temperature is an argument, not a shape).
  np.testing.assert_array_equal(generate(model, temperature=1.0), want_sampled)
  saved = sorted(p.name.rsplit("-", 1)[0] for p in folder.iterdir())
  assert saved == ["engine-decode", "engine-prefill"]
  longer = jnp.asarray([[5, 9, 2, 7, 1, 1, 3, 8, 4]], jnp.int32)  # the same prompt bucket
  engine.generate(model, longer, max_new_tokens=6, rng=jax.random.key(3), temperature=0.0)
  assert len(list(folder.iterdir())) == 2

  # A later process: nothing in memory, and no tracing (export refused), only loading.
  forget(monkeypatch)
  monkeypatch.setattr(jax.export, "export", lambda *a, **k: pytest.fail("traced again"))
  np.testing.assert_array_equal(generate(model), want_greedy)
  np.testing.assert_array_equal(generate(model, temperature=1.0), want_sampled)


def test_the_key_names_the_model_the_arguments_and_the_code(model, monkeypatch):
  graphdef, params = model
  args = (jax.tree.leaves(params), jnp.zeros((1, 64), jnp.int32))
  key = programs.key("generate", graphdef, args)
  assert programs.key("generate", graphdef, args) == key
  # The same shapes, another model: RoPE's theta is in the graph, not in an array's shape.
  cfg = experiments.get_config("lm/shakespeare-char:smoke").model
  cfg.position.theta = 500_000.0
  other = nnx.graphdef(models.build(cfg))
  assert programs.key("generate", other, args) != key
  assert programs.key("generate", graphdef, (args[0], jnp.zeros((1, 128), jnp.int32))) != key
  monkeypatch.setattr(programs, "source_digest", lambda: "edited")
  assert programs.key("generate", graphdef, args) != key


def test_a_damaged_program_is_traced_again(model, tmp_path, monkeypatch, capsys):
  want = generate(model)
  folder = tmp_path / "exported"
  monkeypatch.setattr(programs, "directory", lambda: str(folder))
  forget(monkeypatch)
  generate(model)
  path = sorted(folder.iterdir())[0]
  path.write_bytes(path.read_bytes()[:100])
  forget(monkeypatch)
  np.testing.assert_array_equal(generate(model), want)
  assert "does not load" in capsys.readouterr().err
  assert len(path.read_bytes()) > 100  # saved whole again


def test_a_program_readied_from_abstract_params_is_the_one_generate_runs(model, tmp_path,
                                                                         monkeypatch):  # fmt: skip
  """`engine.prepare` with the params' shapes only (what `zoo chat` can do before they are
  restored) traces and compiles the programs; `generate` then runs them, tracing nothing."""
  want = generate(model)
  graphdef, params = model
  monkeypatch.setattr(programs, "directory", lambda: str(tmp_path / "exported"))
  forget(monkeypatch)
  shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
  options = dict(max_new_tokens=6, rng=jax.random.key(3), temperature=0.0)
  engine.prepare((graphdef, shapes), 1, 4, **options)
  assert len(programs._loaded) == 2
  monkeypatch.setattr(jax.export, "export", lambda *a, **k: pytest.fail("traced again"))
  np.testing.assert_array_equal(generate(model), want)
  assert len(programs._loaded) == 2
