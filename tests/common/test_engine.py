"""The engine (common/engine.py) against independent references: its sampling rules (greedy,
top-k, top-p, temperature, per row), each slot's tokens and log-probabilities against the same
prompt run alone through the whole model without a cache (every decoder family, sliding windows
and soft-caps included), admission mid-flight, prefix reuse, cancellation, new weights, and the
static batches every caller runs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnx_zoo.common import engine, models
from nnx_zoo.common.errors import UserError
from nnx_zoo.zoo.llama import model as llama


def test_sample_logits_temperature_zero_and_top_k_one_are_argmax():
  logits = jnp.asarray(np.random.default_rng(12).standard_normal((64, 32)), jnp.float32)
  want = np.argmax(np.asarray(logits), -1)
  np.testing.assert_array_equal(
    engine.sample_logits(logits, jax.random.key(0), temperature=0, top_k=0, top_p=1.0), want
  )
  for seed in range(3):
    got = engine.sample_logits(logits, jax.random.key(seed), temperature=1.5, top_k=1, top_p=1.0)
    np.testing.assert_array_equal(got, want)


def draw(logits_V, n=512, seed=0, **kw):
  """The set of tokens drawn in n independent samples from one row of logits."""
  logits_BV = jnp.tile(jnp.asarray(logits_V, jnp.float32)[None], (n, 1))
  return set(np.asarray(engine.sample_logits(logits_BV, jax.random.key(seed), **kw)).tolist())


@pytest.mark.parametrize(
  "top_p,want",
  [(0.3, {2}), (0.75, {2, 0}), (0.85, {2, 0, 3}), (0.99, {2, 0, 3, 1}), (1.0, {2, 0, 3, 1})],
)
def test_top_p_keeps_the_smallest_set_reaching_p(top_p, want):
  # Probabilities by construction: token 2: 0.5, 0: 0.3, 3: 0.15, 1: 0.05.
  logits = np.log([0.3, 0.05, 0.5, 0.15])
  assert draw(logits, temperature=1.0, top_k=0, top_p=top_p) == want


def np_nucleus(logits_V, temperature, top_p):
  """Independent reference: sort by probability, keep tokens until their mass reaches top_p."""
  z = np.asarray(logits_V, np.float64) / temperature
  p = np.exp(z - z.max())
  p /= p.sum()
  keep, mass = set(), 0.0
  for i in np.argsort(-p):
    keep.add(int(i))
    mass += p[i]
    if mass >= top_p:
      break
  return keep


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_top_p_samples_stay_in_the_nucleus(temperature):
  rng = np.random.default_rng(13)
  for seed in range(3):
    logits = rng.standard_normal(16) * 2
    got = draw(logits, n=256, seed=seed, temperature=temperature, top_k=0, top_p=0.6)
    assert got <= np_nucleus(logits, temperature, 0.6)


@pytest.mark.parametrize("top_k", [1, 3, 5])
def test_temperature_sampling_stays_in_top_k(top_k):
  rng = np.random.default_rng(14)
  for seed in range(3):
    logits = rng.standard_normal(32)
    top = set(np.argsort(-logits)[:top_k].tolist())
    got = draw(logits, n=256, seed=seed, temperature=2.0, top_k=top_k, top_p=1.0)
    assert got <= top
    if top_k > 1:
      assert len(got) > 1  # sampling, not argmax


def rows_settings():
  """Four rows, each with its own settings: greedy, top-k 3, top-p 0.6, plain temperature."""
  temperature = np.array([0.0, 2.0, 1.0, 1.5], np.float32)
  top_k = np.array([0, 3, 0, 0], np.int32)
  top_p = np.array([1.0, 1.0, 0.6, 1.0], np.float32)
  return temperature, top_k, top_p


def test_sample_rows_applies_each_rows_own_settings():
  rng = np.random.default_rng(15)
  logits_SV = rng.standard_normal((4, 16)).astype(np.float32) * 2
  temperature, top_k, top_p = rows_settings()
  draws = [set() for _ in range(4)]
  for seed in range(64):
    keys = jax.random.split(jax.random.key(seed), 4)
    got = engine.sample_rows(logits_SV, keys, temperature, top_k, top_p, truncate=True)
    for s, token in enumerate(np.asarray(got)):
      draws[s].add(int(token))
  assert draws[0] == {int(np.argmax(logits_SV[0]))}
  assert draws[1] <= set(np.argsort(-logits_SV[1])[:3].tolist()) and len(draws[1]) > 1
  assert draws[2] <= np_nucleus(logits_SV[2], 1.0, 0.6)
  assert len(draws[3]) > 3


def test_sample_rows_draws_what_sample_logits_draws_row_by_row():
  """The per-row sampler is the static one (what the encoder-decoder loop runs) row by row, with
  the truncation compiled only where asked: a row that does not truncate draws the same token
  either way."""
  rng = np.random.default_rng(16)
  logits_SV = jnp.asarray(rng.standard_normal((4, 32)), jnp.float32)
  temperature, top_k, top_p = rows_settings()
  keys = jax.random.split(jax.random.key(3), 4)
  got = np.asarray(engine.sample_rows(logits_SV, keys, temperature, top_k, top_p, truncate=True))
  for s in range(4):
    want = engine.sample_logits(
      logits_SV[s : s + 1], keys[s], temperature=float(temperature[s]), top_k=int(top_k[s]),
      top_p=float(top_p[s]),
    )  # fmt: skip
    assert got[s] == int(want[0])
  plain = np.asarray(engine.sample_rows(logits_SV, keys, temperature, 0 * top_k, 1 + 0 * top_p,
                                        truncate=False))  # fmt: skip
  assert plain[0] == got[0] and plain[3] == got[3]


def tiny_decoder():
  return models.build(llama.config("tiny", vocab_size=64), seed=3)


# The decoder families' tiny configs, each with what sets it apart in decoding: sliding windows
# (Mistral; Gemma 2's local layers, with soft-caps), experts, learned positions (GPT-2), and the
# stacked layers of model.scan. (Qwen's QKV bias and QK-norm and Gemma 3's pattern change only
# the projections, not the cache: listed in `family`, not run, to keep the suite's time.)
def family(name):
  from nnx_zoo.zoo.gemma import model as gemma
  from nnx_zoo.zoo.gpt2 import model as gpt2

  configs = {
    "llama": lambda: llama.config("tiny"),
    "mistral": lambda: llama.config("tiny", window=5),
    "qwen3": lambda: llama.config("tiny", qkv_bias=True, qk_norm="rms"),
    "moe": lambda: llama.config("tiny", num_experts=4, top_k=2),
    "gemma2": lambda: gemma.config("tiny"),
    "gemma3": lambda: gemma.config("tiny", version=3, window=4),
    "gpt2": lambda: gpt2.config("tiny"),
    "scanned": lambda: llama.config("tiny", num_layers=4),
  }
  cfg = configs[name]()
  cfg.init_std = 0.2  # attention far from uniform
  if name == "scanned":
    cfg.scan = True
  return models.build(cfg, seed=0)


FAST = ("llama", "gemma2")


@pytest.mark.parametrize(
  "name",
  [n if n in FAST else pytest.param(n, marks=pytest.mark.slow) for n in
   ("llama", "gemma2", "mistral", "moe", "gpt2", "scanned")],
)  # fmt: skip
def test_each_slot_equals_its_prompt_alone_without_a_cache(name):
  """Three requests admitted at different steps, their prompts read 4 tokens a step beside the
  others' decoding, each slot at its own position: every greedy token is the argmax of the
  whole model run on the prompt and the tokens before it (no cache, no neighbours), and every
  log-probability its log-softmax, to 1e-5."""
  model = family(name)
  graphdef, params = nnx.split(model)
  full = jax.jit(lambda p, t: jax.nn.log_softmax(nnx.merge(graphdef, p)(t), axis=-1))
  rng = np.random.default_rng(7)
  prompts = [rng.integers(0, 256, n).tolist() for n in (13, 2, 6)]
  N = 6
  eng = engine.Engine((graphdef, params), slots=3, max_len=24, prefill_chunk=4)
  greedy = engine.SamplingParams(N, temperature=0.0, logprobs=0)
  got = {}
  for step in range(64):
    if step in (0, 2, 3):
      got[eng.submit(prompts[(0, 2, 3).index(step)], greedy)] = ([], [])
    for out in eng.step():
      got[out.rid][0].extend(out.tokens)
      got[out.rid][1].extend(out.logprobs)
    if not eng.busy:
      break
  for rid, prompt in enumerate(prompts):
    tokens, lps = got[rid]
    assert len(tokens) == N
    row = np.asarray([prompt + tokens], np.int32)
    want = np.asarray(full(params, row))[0, len(prompt) - 1 : -1]
    np.testing.assert_array_equal(tokens, want.argmax(-1))
    np.testing.assert_allclose(lps, want[np.arange(N), tokens], atol=1e-5)


def run_requests(eng, requests, *, admit_at=None):
  """Each request's (tokens, finish) once every one ended; request i submitted before step
  admit_at[i] (default: all at once). A request is (prompt, params, seed)."""
  admit_at = admit_at or [0] * len(requests)
  rids, out, step = {}, {}, 0
  while len(rids) < len(requests) or eng.busy:
    for i, (prompt, params, seed) in enumerate(requests):
      if admit_at[i] == step:
        rids[eng.submit(prompt, params, seed=seed)] = i
    for o in eng.step():
      tokens, _ = out.get(rids[o.rid], ([], None))
      out[rids[o.rid]] = (tokens + o.tokens, o.finish_reason)
    step += 1
  return [out[i] for i in range(len(requests))]


@pytest.fixture(scope="module")
def split_decoder():
  return nnx.split(tiny_decoder())


def test_a_requests_draws_depend_on_its_seed_not_its_neighbours(split_decoder):
  """Sampled with top-k and top-p, a request gets the same tokens alone on a one-slot engine as
  beside others admitted before and after it, in another slot; another seed, other tokens."""
  rng = np.random.default_rng(8)
  sampled = engine.SamplingParams(10, temperature=1.2, top_k=20, top_p=0.9)
  mine = (rng.integers(1, 64, 7).tolist(), sampled, 11)
  others = [(rng.integers(1, 64, n).tolist(), sampled, 5 + n) for n in (3, 12, 5)]
  alone = run_requests(engine.Engine(split_decoder, slots=1, max_len=32), [mine])[0]
  crowd = engine.Engine(split_decoder, slots=3, max_len=32, prefill_chunk=4)
  beside = run_requests(crowd, [others[0], others[1], mine, others[2]], admit_at=[0, 0, 2, 4])
  assert beside[2] == alone
  reseeded = run_requests(crowd, [(mine[0], sampled, 12)])[0]
  assert reseeded[0] != alone[0]


def test_prefix_reuse_skips_the_held_tokens_and_changes_nothing(split_decoder):
  """The next turn of a conversation (its prompt: the last prompt, its reply and more) reads
  only what the slot does not hold, and gets the tokens a fresh engine gives it."""
  rng = np.random.default_rng(9)
  greedy = engine.SamplingParams(6, temperature=0.0)
  first = rng.integers(1, 64, 9).tolist()
  eng = engine.Engine(split_decoder, slots=2, max_len=48, prefill_chunk=8)
  rid = eng.submit(first, greedy)
  reply = []
  while eng.busy:
    for o in eng.step():
      reply += o.tokens
      cached = o.cached_tokens
  assert cached == 0
  second = first + reply + rng.integers(1, 64, 5).tolist()
  rid = eng.submit(second, greedy)
  got, cached = [], None
  while eng.busy:
    for o in eng.step():
      assert o.rid == rid
      got += o.tokens
      cached = o.cached_tokens
  # The slot held the prompt and all of the reply but its last token (never fed).
  assert cached == len(first) + len(reply) - 1
  fresh = run_requests(engine.Engine(split_decoder, slots=1, max_len=48), [(second, greedy, 0)])
  assert got == fresh[0][0]
  eng.set_weights(split_decoder[1])  # new weights: the prefixes are forgotten
  eng.submit(second, greedy)
  assert [o.cached_tokens for o in eng.step()] in ([0], [])


def test_a_prefix_another_slot_holds_is_copied_not_read_again(split_decoder):
  """Four requests at once: two copies of one prompt (a GRPO group) and two others sharing its
  18-token system prefix. The first reads its prompt (in chunks of 8, so the others wait for
  it), the rest copy its cache row and read only what is theirs; every token and
  log-probability is what an engine that shares nothing gives."""
  rng = np.random.default_rng(12)
  system = rng.integers(1, 64, 18).tolist()
  group = system + [5, 6]
  prompts = [group, group, system + [7, 8, 9, 10, 11], system + [12, 13, 14, 15, 16]]
  greedy = engine.SamplingParams(6, temperature=0.0, logprobs=0)

  def run(share):
    eng = engine.Engine(split_decoder, slots=4, max_len=48, prefill_chunk=8,
                        share_prefixes=share)  # fmt: skip
    rids = [eng.submit(p, greedy) for p in prompts]
    got = {rid: ([], [], None) for rid in rids}
    while eng.busy:
      for o in eng.step():
        tokens, lps, cached = got[o.rid]
        got[o.rid] = (tokens + o.tokens, lps + o.logprobs, o.cached_tokens)
    return [got[rid] for rid in rids]

  shared, alone = run(True), run(False)
  assert [c for _, _, c in alone] == [0, 0, 0, 0]
  # The copy holds all of its prompt but the last token; the others, the system prefix.
  assert [c for _, _, c in shared] == [0, len(group) - 1, len(system), len(system)]
  for (tokens, lps, _), (want, want_lps, _) in zip(shared, alone, strict=True):
    assert tokens == want
    np.testing.assert_allclose(lps, want_lps, atol=1e-5)
  # Copied only where the prefix is MIN_SHARED tokens or more.
  short = engine.Engine(split_decoder, slots=2, max_len=48)
  short.submit(system[: engine.MIN_SHARED - 2] + [1, 2], greedy)
  short.submit(system[: engine.MIN_SHARED - 2] + [3, 4], greedy)
  assert {o.cached_tokens for o in short.step()} == {0}


def test_stop_ids_max_tokens_and_cancel_end_a_request_and_free_its_slot(split_decoder):
  rng = np.random.default_rng(10)
  prompt = rng.integers(1, 64, 5).tolist()
  eng = engine.Engine(split_decoder, slots=1, max_len=40)
  free = run_requests(eng, [(prompt, engine.SamplingParams(12, temperature=0.0), 0)])[0]
  assert free[1] == "length" and len(free[0]) == 12
  stop = free[0][4]
  first = free[0].index(stop)
  stopped = engine.SamplingParams(12, temperature=0.0, stop_ids=(stop,))
  assert run_requests(eng, [(prompt, stopped, 0)])[0] == (free[0][: first + 1], "stop")
  # One slot: the second request waits, and runs once the first is cancelled.
  a = eng.submit(prompt, engine.SamplingParams(12, temperature=0.0), seed=0)
  b = eng.submit(prompt[:3], engine.SamplingParams(2, temperature=0.0), seed=0)
  eng.step()
  assert eng.num_running == 1 and eng.num_waiting == 1
  eng.cancel(a)
  outs = eng.step()
  assert any(o.rid == a and o.finish_reason == "cancelled" for o in outs)
  while eng.busy:
    outs += eng.step()
  assert [o.finish_reason for o in outs if o.rid == b][-1] == "length"


def test_bad_requests_and_a_cache_that_does_not_fit_are_refused(split_decoder, monkeypatch):
  eng = engine.Engine(split_decoder, slots=2, max_len=16)
  with pytest.raises(UserError, match=r"prompt's 12 tokens plus max_tokens=8 exceed .* 16"):
    eng.submit(list(range(12)), engine.SamplingParams(8))
  with pytest.raises(UserError, match="empty"):
    eng.submit([], engine.SamplingParams(8))
  with pytest.raises(UserError, match="top_p"):
    eng.submit([1], engine.SamplingParams(2, top_p=0.0))
  monkeypatch.setenv("NNX_ZOO_MEMORY_BUDGET", "4MiB")
  with pytest.raises(UserError, match=r"KV cache of 64 slots x 4096 tokens needs .* --slots \d+"):
    engine.Engine(split_decoder, slots=64, max_len=4096)


def test_logprobs_and_prompt_logprobs_are_the_models(split_decoder):
  """Top log-probabilities of the generated tokens and of the prompt's (echo), against the
  log-softmax of the whole model on the row."""
  graphdef, params = split_decoder
  prompt = np.random.default_rng(11).integers(1, 64, 9).tolist()
  eng = engine.Engine(split_decoder, slots=1, max_len=32, prefill_chunk=4)
  eng.submit(prompt, engine.SamplingParams(3, temperature=0.0, logprobs=2, prompt_logprobs=True))
  outs = []
  while eng.busy:
    outs += eng.step()
  tokens = sum((o.tokens for o in outs), [])
  row = np.asarray([prompt + tokens], np.int32)
  want = np.asarray(jax.nn.log_softmax(nnx.merge(graphdef, params)(row), axis=-1))[0]
  assert outs[0].prompt_logprobs[0] is None and len(outs[0].prompt_logprobs) == len(prompt)
  for t in range(1, len(prompt)):
    assert abs(outs[0].prompt_logprobs[t] - want[t - 1, prompt[t]]) < 1e-5
    top = outs[0].prompt_top_logprobs[t]
    assert [i for i, _ in top] == np.argsort(-want[t - 1])[:2].tolist()
  lps = sum((o.logprobs for o in outs), [])
  tops = sum((o.top_logprobs for o in outs), [])
  for j, token in enumerate(tokens):
    t = len(prompt) - 1 + j
    assert abs(lps[j] - want[t, token]) < 1e-5
    assert tops[j][0][0] == token  # greedy: the most likely


def test_stop_ids_end_each_row_where_it_stops_and_nothing_else_changes():
  """A row stops at its first stop token (filled with it after), and the rows that do not stop
  are the tokens they would have been: the same tokens as the stepwise reference."""
  model = tiny_decoder()
  prompt = np.random.default_rng(0).integers(0, 64, (3, 7))
  free = np.asarray(
    engine.generate(model, prompt, max_new_tokens=12, rng=jax.random.key(0), temperature=0)
  )
  np.testing.assert_array_equal(free, engine.generate_stepwise(model, prompt, max_new_tokens=12))
  stop = int(free[0, 7 + 4])  # row 0's fifth new token
  got = np.asarray(
    engine.generate(
      model, prompt, max_new_tokens=12, rng=jax.random.key(0), temperature=0, stop_ids=(stop,)
    )
  )
  for row_free, row in zip(free[:, 7:], got[:, 7:], strict=True):
    hits = np.flatnonzero(row_free == stop)
    end = hits[0] + 1 if len(hits) else len(row_free)
    np.testing.assert_array_equal(row[:end], row_free[:end])
    assert (row[end:] == stop).all()


def test_prompts_of_one_bucket_share_programs(monkeypatch):
  """Prompts of 3 and 11 tokens read in one chunk of the same bucket and decode in the same
  cache: one prefill and one decode program for both."""
  monkeypatch.setattr(engine, "_PROGRAMS", {})
  model = tiny_decoder()
  for length in (3, 11):
    engine.generate(
      model, np.ones((1, length), np.int32), max_new_tokens=4, rng=jax.random.key(0), temperature=0
    )
  assert sorted(k[0] for k in engine._PROGRAMS) == ["decode", "prefill"]


def ragged_prompts(seed=5):
  rng = np.random.default_rng(seed)
  lengths = np.array([3, 9, 6, 1], np.int32)
  P = 9
  prompt = rng.integers(1, 64, (4, P)) * (np.arange(P)[None] < lengths[:, None])
  return prompt.astype(np.int32), lengths


@pytest.mark.slow
def test_continue_rows_on_ragged_prompts_with_stop_ids_equals_the_stepwise_reference():
  """At temperature 0, rows of prompts of 1 to 9 tokens in one static batch each get the tokens
  the stepwise reference gives that prompt alone, up to the row's first stop id, and the stop
  id after it; padding the prompts further changes nothing."""
  model = tiny_decoder()
  graphdef, params = nnx.split(model)
  prompt, lengths = ragged_prompts()
  N = 10
  free = [
    np.asarray(engine.generate_stepwise(model, prompt[b : b + 1, :n], max_new_tokens=N))[0, n:]
    for b, n in enumerate(lengths)
  ]
  stop = int(free[0][3])  # row 0's fourth new token
  keys = jax.random.split(jax.random.key(0), 4)
  kw = dict(graphdef=graphdef, max_new_tokens=N, temperature=0.0, stop_ids=(stop,))
  for pad in (0, 7):
    out = engine.continue_rows(params, np.pad(prompt, ((0, 0), (0, pad))), lengths, keys, **kw)
    for b, n in enumerate(lengths):
      np.testing.assert_array_equal(out[b, :n], prompt[b, :n])
      hits = np.flatnonzero(free[b] == stop)
      end = hits[0] + 1 if len(hits) else N
      np.testing.assert_array_equal(out[b, n : n + end], free[b][:end])
      assert (out[b, n + end : n + N] == stop).all()
