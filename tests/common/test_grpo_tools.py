"""GRPO with tools (grpo.tools, grpo.environment: common/tasks/episodes.py): each bad input
refused in one line before any step, and runs through the trainer whose episodes call a tool
(turns drawn on the host and read as calls: a random model makes none and seldom ends its turn;
tests/common/test_tools.py runs episodes on the real engine), logged, with the loss on the
model's tokens only, resumed bit for bit."""

import json

import numpy as np
import pytest

from nnx_zoo.common import experiments, tasks
from nnx_zoo.common.errors import UserError
from nnx_zoo.common.tasks import episodes, grpo, tool_calls
from nnx_zoo.common.train import trainer

TOOLS_PY = '''
def multiply(a: int, b: int) -> int:
  """Multiplies two integers.

  Args:
    a: The first factor.
    b: The second factor.
  """
  return a * b


def no_doc(a: int) -> int:
  return a


class Counter:
  def reset(self, answer, **_):
    self.answer, self.calls = answer, 0
    return f"(answer {answer})"

  def count(self, step: int) -> int:
    """Counts.

    Args:
      step: How much.
    """
    self.calls += step
    return self.calls

  def reward(self):
    return float(self.calls)


class NoReset:
  pass
'''
REWARDS_PY = """
def has_answer(prompts, completions, answer, **_):
  return [float(any(str(a) in (m.get("content") or "") for m in c))
          for c, a in zip(completions, answer)]
"""
# ChatML that takes tools (a short system line: the prompts stay short in tiny:llama's tokens).
SHORT = (
  "{% if tools %}<|im_start|>system\n{{ tools | length }} tools<|im_end|>\n{% endif %}"
  "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def overrides(tmp_path, **more) -> dict:
  """chat/grpo:smoke's overrides for episodes calling `multiply` on 8 training prompts (their
  files written in tmp_path)."""
  records = [
    {"prompt": [{"role": "user", "content": f"{i} x 2?"}], "answer": str(2 * i)} for i in range(12)
  ]
  for name, part in (("train", records[:8]), ("eval", records[8:])):
    with open(tmp_path / f"{name}.jsonl", "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in part)
  (tmp_path / "tools.py").write_text(TOOLS_PY)
  (tmp_path / "rewards.py").write_text(REWARDS_PY)
  (tmp_path / "short.jinja").write_text(SHORT)
  base = {
    "data.kind": "files",
    "data.train_files": str(tmp_path / "train.jsonl"),
    "data.eval_files": str(tmp_path / "eval.jsonl"),
    "data.chat_template": str(tmp_path / "short.jinja"),
    "grpo.reward": f"{tmp_path / 'rewards.py'}:has_answer",
    "grpo.tools": f"{tmp_path / 'tools.py'}:multiply",
    "grpo.max_turns": "3",
    "grpo.max_new_tokens": "6",
    "grpo.max_episode_tokens": "64",
    "train.steps": "4",
    "train.checkpoint_every": "2",
    "train.eval_every": "4",
  }
  return {**base, **more}


def config(tmp_path, **more):
  return experiments.get_config("chat/grpo:smoke", overrides(tmp_path, **more))


def test_each_bad_input_is_refused_before_a_step(tmp_path):
  f = tmp_path / "tools.py"
  for overrides, match in (
    ({"grpo.tools": f"{tmp_path}/none.py:multiply"}, "none.py is not a file"),
    ({"grpo.tools": f"{f}:divide"}, "has no 'divide'"),
    ({"grpo.tools": f"{f}:no_doc"}, "'no_doc' cannot be a tool .*no docstring"),
    ({"grpo.environment": f"{f}:NoReset"}, "NoReset has no reset"),
    ({"grpo.environment": f"{f}:Missing"}, "has no 'Missing'"),
    ({"grpo.call_forms": "template,xml"}, "grpo.call_forms"),
    ({"grpo.max_turns": "0"}, "grpo.max_turns=0"),
    ({"grpo.max_episode_tokens": "4"}, "less than max_new_tokens"),
  ):
    cfg = config(tmp_path, **overrides)
    with pytest.raises(UserError, match=match):
      tasks.of(cfg)
  # A chat template that takes no tools: refused as the task is prepared, before a step.
  cfg = config(tmp_path, **{"data.chat_template": ""})
  with pytest.raises(UserError, match="takes no tools"):
    trainer.train(cfg, str(tmp_path / "run"), progress=False)
  assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_an_environment_without_functions_is_the_reward(tmp_path):
  cfg = config(tmp_path, **{"grpo.tools": "", "grpo.reward": "",
                            "grpo.environment": f"{tmp_path / 'tools.py'}:Counter"})  # fmt: skip
  task = tasks.of(cfg)
  assert [(r.name, r.fn, r.weight) for r in task.rewards] == [("environment", None, 1.0)]
  assert [s["function"]["name"] for s in task.agent.schemas] == ["count"]
  cfg = config(tmp_path, **{"grpo.call_format_reward": "0.5"})
  assert [r.name for r in tasks.of(cfg).rewards] == ["has_answer", "call_format"]
  assert grpo.completion_cap(tasks.of(cfg).s) == 3 * 6  # dr_grpo's: turns x a turn's tokens


class Drawn:
  """An engine whose turns are drawn on the host from the request's key and prompt length: 1 to
  max_tokens - 1 tokens, then the end of turn (a random model seldom ends its turn). Its
  tokens depend on the key as the engine's do, so a resumed run must give the same keys."""

  def __init__(self):
    self.waiting, self.rid = [], 0

  @property
  def busy(self):
    return bool(self.waiting)

  def submit(self, prompt, params, *, key):
    import jax

    seed = [int(x) for x in np.asarray(jax.random.key_data(key)).reshape(-1)] + [len(prompt)]
    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, 300, rng.integers(1, params.max_tokens)).tolist()
    self.waiting.append((self.rid, tokens + [params.stop_ids[0]]))
    self.rid += 1
    return self.rid - 1

  def step(self):
    from nnx_zoo.common import engine

    rid, tokens = self.waiting.pop(0)
    return [engine.Output(rid, tokens, finish_reason="stop")]


def always_call(monkeypatch, name="multiply", arguments='{"a": 2, "b": 3}'):
  """Every turn read as a call of `name`: a random model's episodes then go on to max_turns."""
  call = tool_calls.ToolCall(name, arguments)
  monkeypatch.setattr(
    tool_calls.Reader, "read", lambda self, text: tool_calls.Reading(text, [call], "template")
  )
  monkeypatch.setattr(episodes, "engine_for", lambda *a: lambda count, longest: Drawn())


def recorded(monkeypatch, stop_at=None):
  """Each training step's rows (tokens, loss_weights, segment_ids); with `stop_at`, the run
  stops as that many steps have been sampled."""
  seen, complete = [], grpo.GRPO.complete

  def recording(self, batch, params):
    if stop_at is not None and len(seen) == stop_at and "seed" in batch:
      raise UserError("stopped by the test")
    out = complete(self, batch, params)
    if "advantages" in out:
      seen.append({k: np.asarray(out[k]) for k in ("tokens", "loss_weights", "segment_ids")})
    return out

  monkeypatch.setattr(grpo.GRPO, "complete", recording)
  return seen


@pytest.mark.slow
def test_episodes_train_log_and_resume_bit_for_bit(tmp_path, monkeypatch):
  """4 steps of episodes that call `multiply` (scripted turns) through the trainer: the
  lines log turns, calls, the share parsed and the tokens; the loss weights are the model's
  tokens only (the tool's result is in the rows, out of the loss); 2 steps, stop, and 2 resumed
  replay steps 3 and 4's episodes bit for bit."""
  always_call(monkeypatch)
  played = []
  run = episodes.Agent.run
  monkeypatch.setattr(
    episodes.Agent, "run", lambda self, *a, **k: played.append(run(self, *a, **k)) or played[-1]
  )
  straight = recorded(monkeypatch)
  cfg = config(tmp_path)
  trainer.train(cfg, str(tmp_path / "straight"), progress=False)
  with open(tmp_path / "straight" / "metrics.jsonl") as f:
    lines = [json.loads(line) for line in f]
  train = [r for r in lines if "split" not in r]
  assert len(train) == 4
  for r in train:
    for key in ("turns", "tool_calls", "calls_parsed", "unparsed_turns", "tool_errors",
                "tool_timeouts", "model_tokens", "context_tokens", "reward"):  # fmt: skip
      assert key in r and np.isfinite(r[key]), (key, r)
    assert r["calls_parsed"] == 1 and r["tool_errors"] == 0
    assert 1 <= r["turns"] <= 3 and r["context_tokens"] > 0
  # The rows: the model's tokens weighted, the context (the tool's "6") not.
  eps = played[0]
  for row, ep in zip(straight[0]["loss_weights"], eps, strict=True):  # truncated: "keep"
    mask = np.zeros(len(row), bool)
    mask[: len(ep.mask)] = ep.mask
    np.testing.assert_array_equal(row > 0, mask)
  assert any(ep.turns > 1 for ep in eps)
  assert any(m["role"] == "tool" and m["content"] == "6" for ep in eps for m in ep.messages)
  evals = [r for r in lines if r.get("split") == "eval"]
  assert evals and "reward/has_answer" in evals[-1]
  monkeypatch.undo()
  always_call(monkeypatch)
  seen = recorded(monkeypatch, stop_at=2)
  with pytest.raises(UserError, match="stopped by the test"):
    trainer.train(cfg, str(tmp_path / "resumed"), progress=False)
  monkeypatch.undo()
  always_call(monkeypatch)
  rest = recorded(monkeypatch)
  trainer.train(cfg, str(tmp_path / "resumed"), progress=False)
  seen += rest
  assert len(seen) == 4
  for a, b in zip(straight, seen, strict=True):
    for k in a:
      np.testing.assert_array_equal(a[k], b[k])
  assert not np.array_equal(straight[2]["tokens"], straight[3]["tokens"])
