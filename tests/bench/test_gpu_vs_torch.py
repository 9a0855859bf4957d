"""bench/gpu_vs_torch.py, which needs a GPU for its figures: its arguments, the models it builds
(docs/gpu.md's 1.24 B Llama and a ~0.9 B-active Mixtral), its FLOP counts against a hand count,
its table, JSON and .ci/gpu summary, and a tiny run on the CPU (each row failing alone)."""

import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest

from nnx_zoo.common import models

ROOT = pathlib.Path(__file__).resolve().parents[2]


def load():
  spec = importlib.util.spec_from_file_location("gpu_vs_torch", ROOT / "bench" / "gpu_vs_torch.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


bench = load()


def test_arguments():
  args = bench.parse_args([])
  assert args.parts == ["dense", "moe", "long"] and args.steps == 5 and not args.tiny
  args = bench.parse_args(["--tiny", "--parts", "dense", "--impls", "auto,xla"])
  assert args.parts == ["dense"] and args.impls == ["auto", "xla"] and args.steps == 2
  for bad in (["--parts", "sparse"], ["--impls", "splash"]):
    with pytest.raises(SystemExit):
      bench.parse_args(bad)


def test_impls_per_platform_auto_first():
  assert bench.impls_for("gpu", []) == ["auto", "cudnn", "flash", "xla"]
  assert bench.impls_for("cpu", []) == ["auto", "xla"]
  assert bench.impls_for("gpu", ["xla", "auto"]) == ["auto", "xla"]


def test_models_and_flops_are_the_issues():
  """The dense row is docs/gpu.md's model (1.24 B, batch 8 x 2048, bf16, scan, no remat); FLOPs are
  MaxText's count, checked by hand here; the MoE row counts its active MLP work."""
  cfgs = bench.configs(tiny=False)
  dense, _ = cfgs["dense"]
  m = dense.model
  assert models.num_params(m) == 1_235_814_400
  assert (dense.train.batch_size, dense.data.seq_len) == (8, 2048)
  assert (m.dtype, m.scan, m.remat) == ("bfloat16", True, "none")
  B, T = 8, 2048
  D, F, V, L, N, K, H = 2048, 8192, 128256, 16, 32, 8, 64
  matmul = L * (D * (N + 2 * K) * H + N * H * D + 3 * D * F) + D * V
  want = 3 * (2 * matmul * B * T + L * 4 * B * T * T * N * H / 2)
  assert bench.step_flops(dense, B, T) == want
  moe, moe_flops = cfgs["moe"]
  active = models.num_active_params(moe.model)
  assert 0.8e9 < active < 1.0e9 and models.num_params(moe.model) < 2.7e9
  mlp = moe.model.mlp
  assert moe_flops.model.mlp.hidden_dim == mlp.top_k * mlp.hidden_dim
  assert moe_flops.model.mlp.kind == "dense"
  long, _ = cfgs["long"]
  assert long.data.seq_len == 8192


def test_table_json_and_summary(tmp_path):
  rows = [
    {"part": "dense", "name": "zoo auto", **bench.row("zoo auto", 0.292, 16384, 128e12, 2**34)},
    {"part": "dense", "name": "zoo xla", "error": "XlaRuntimeError: RESOURCE_EXHAUSTED: 124.8G"},
  ]
  result = {"device": "NVIDIA H200 (gpu)", "jax": "x", "peaks": {"jnp": 635e12}, "rows": rows}
  bench.add_mfu(rows, result["peaks"])
  assert rows[0]["mfu_vs_jnp"] == pytest.approx(128e12 / 0.292 / 635e12)
  assert "mfu_vs_jnp" not in rows[1]
  table = bench.format_table(result)
  assert "| dense | zoo auto | 292 | 56110 | 438.4 | 69% | - | 16.0 |  |" in table
  assert "| dense | zoo xla | - |" in table and "RESOURCE_EXHAUSTED" in table
  bench.write_json(result, tmp_path / "bench.json")
  (tmp_path / "tests.json").write_text(json.dumps({"part": "tests", "ok": False, "failed": 3}))
  (tmp_path / "shakespeare.json").write_text(
    json.dumps({"part": "shakespeare-char", "ok": True, "seconds": 35})
  )
  summary = bench.summarize(tmp_path)
  assert [p["part"] for p in summary["parts"]] == ["shakespeare-char", "tests"]
  assert summary["bench"] == json.loads((tmp_path / "bench.json").read_text())
  text = bench.format_summary(summary)
  assert "| tests | NO | failed 3 |" in text and "zoo auto" in text
  assert bench.main(["summary", str(tmp_path)]) == 1  # a part failed
  assert json.loads((tmp_path / "summary.json").read_text())["parts"][1]["failed"] == 3


@pytest.mark.slow
def test_tiny_run_on_cpu(tmp_path):
  """The whole script at tiny shapes: the zoo row and the torch eager row, with a JSON file; a
  part asked of torch fails alone when torch's model cannot be built (not here: both run)."""
  pytest.importorskip("transformers")
  out = tmp_path / "bench.json"
  argv = ["--tiny", "--parts", "moe", "--no-compile", "--steps", "1", "--warmup", "1"]
  proc = subprocess.run(
    [sys.executable, str(ROOT / "bench" / "gpu_vs_torch.py"), *argv, "--json", str(out)],
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert proc.returncode == 0, proc.stdout + proc.stderr
  result = json.loads(out.read_text())
  assert [r["name"] for r in result["rows"]] == ["zoo auto", "torch eager"]
  assert all(r["step_ms"] > 0 and r["tokens_per_s"] > 0 for r in result["rows"])
  assert "| moe | zoo auto |" in proc.stdout


def test_ci_gpu_script_parses_and_says_how_to_run_it():
  """.ci/gpu cannot run without a GPU: its bash parses, and --help and a bad flag answer."""
  script = ROOT / ".ci" / "gpu"
  assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
  help_ = subprocess.run(["bash", str(script), "--help"], capture_output=True, text=True)
  assert help_.returncode == 0 and "--system" in help_.stdout
  bad = subprocess.run(["bash", str(script), "--bogus"], capture_output=True, text=True)
  assert bad.returncode == 2 and "unknown argument" in bad.stderr
