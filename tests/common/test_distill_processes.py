"""On-policy distillation on several processes: each process samples the replies of its own rows
(as the grpo task does, docs/distill.md "Limits"), and the step is the trainer's. Two processes
on 127.0.0.1 (one fake CPU device each, mesh data=2) against one process holding both devices,
every batch on-policy (distill.lmbda=1): the same losses, KLs, reply lengths and gradient norms."""

import json

import pytest

pytestmark = [pytest.mark.multidevice, pytest.mark.slow]

SETTINGS = {"distill.lmbda": "1.0", "mesh.data": "2", "train.steps": "2",
            "train.checkpoint_every": "2", "train.eval_every": "2"}  # fmt: skip


def argv(workdir) -> list[str]:
  over = [f"--config.{k}={v}" for k, v in SETTINGS.items()]
  return ["-m", "nnx_zoo.common.cli", "run", "chat/smollm2-distill:smoke", "--workdir", workdir,
          "--quiet", *over]  # fmt: skip


def lines(workdir) -> dict:
  got = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
  return {(x["step"], x.get("split", "train")): x for x in got}


def test_two_processes_sample_their_own_replies_and_train_as_one(tmp_path, forced_devices):
  one, two = tmp_path / "one", tmp_path / "two"
  forced_devices.succeed(argv(one), devices=2)
  forced_devices.finish(forced_devices.hosts(argv(two), processes=2, devices=1))
  want, got = lines(one), lines(two)
  assert want.keys() == got.keys() and (2, "train") in want
  assert [want[(s, "train")]["on_policy"] for s in (1, 2)] == [1.0, 1.0]
  for key, line in want.items():
    for k in ("loss", "teacher_kl", "reply_length", "targets", "grad_norm"):
      if k in line:
        assert got[key][k] == pytest.approx(line[k], rel=1e-5, abs=1e-7), (key, k)
