"""The `zoo` command: list, show, plan, run, eval, generate, chat, serve, data, convert, export,
lm-eval.
See docs/DESIGN.md for the contract."""

import argparse
import json
import os
import sys

from nnx_zoo.common.errors import Preempted, UserError

USAGE = """\
zoo list                                          # the experiments, one line each
zoo show EXP [--memory] [--config.KEY=VALUE ...]  # the resolved config and parameter count;
                                                  # --memory: the step's memory on this machine
zoo plan EXP --topology NAME [--config.KEY=VALUE ...]  # compile for a TPU slice: memory, time
zoo run  EXP --workdir DIR [--config.KEY=VALUE ...]   # train; resumes if DIR has a checkpoint
             [--restarts N]                        # rerun it, resuming, when it fails or hangs
zoo eval EXP --workdir DIR [--config.KEY=VALUE ...]   # held-out loss of DIR's latest checkpoint
zoo goodput --workdir DIR [--json] [--process I]  # the run's wall time over every attempt:
             goodput, badput by cause, step-time deviation (docs/goodput.md)
zoo generate --workdir DIR --prompt TEXT [--max-new-tokens N --temperature T --top-k K --top-p P]
zoo generate --workdir DIR --audio FILE.wav [--language en --task transcribe]  # a speech
             model's transcript (a speech run, or a converted Whisper checkpoint), window by
             window where the file is longer than the model's window
zoo generate --workdir DIR (--labels 3,3,7 | --num-per-label N) --out FILE.npz [--guidance G
             --steps S --eta E --seed I]             # a class-conditional image model (DiT)
zoo chat --workdir DIR [--messages FILE.json] [--system TEXT]   # talk to a chat model (its
             run's chat template, the KV cache, each answer cut at the end of its turn)
             [--tools FILE.py:fn,...]   # functions it may call, run between its turns
zoo serve --workdir DIR [--host 127.0.0.1] [--port 8000] [--slots N] [--max-len T]
             [--model-name NAME] [--max-queue Q] [--grace-s S] [--api-key KEY]
             [--dtype float32|bfloat16]   # an OpenAI-compatible HTTP server (docs/serving.md)
zoo data prepare EXP --out DIR [--workers N] [--config.KEY=VALUE ...]  # tokenize the
             experiment's sources once (data.kind=prepared, data.path=DIR then trains from them)
zoo data show EXP [--split train|eval] [--rows N] [--json]  # the rows the trainer would see
zoo data bench EXP                                # the pipeline's tokens/s beside the trainer's
zoo convert hf SRC_DIR --out DIR [--param-dtype float32]  # Hugging Face dir -> zoo checkpoint
zoo export hf --workdir DIR --out DIR             # zoo checkpoint -> Hugging Face dir
zoo lm-eval --workdir DIR --tasks T1,T2 [--include-path DIR] [--num-fewshot K] [--limit N]
             [--batch-size B] [--output-path F] [--apply-chat-template]   # EleutherAI's
             lm-evaluation-harness on a decoder (its table; its results JSON in F, default
             DIR/lm_eval/results.json; prompts in the model's chat template if asked)
zoo convert gguf FILE.gguf --out DIR [--param-dtype float32]  # llama.cpp file -> zoo checkpoint
zoo export gguf --workdir DIR --out FILE.gguf [--type f32|f16|bf16|q8_0]  # -> llama.cpp file

EXP is a registered name (lm/shakespeare-char) or a path to an experiment file, either with an
optional argument after a colon (lm/llama3-8b:smoke).
"""


def split_overrides(argv: list[str]) -> tuple[list[str], dict[str, str]]:
  """Pulls `--config.KEY=VALUE` (or `--config.KEY VALUE`) out of argv."""
  rest, overrides = [], {}
  i = 0
  while i < len(argv):
    arg = argv[i]
    if arg.startswith("--config."):
      key, eq, value = arg[len("--config.") :].partition("=")
      if not eq:
        if i + 1 >= len(argv):
          raise UserError(f"{arg} has no value: write {arg}=VALUE.")
        value, i = argv[i + 1], i + 1
      overrides[key] = value
    else:
      rest.append(arg)
    i += 1
  return rest, overrides


class Parser(argparse.ArgumentParser):
  def error(self, message):  # one clean line like every other user error, not usage + message
    raise UserError(f"{message}. Usage:\n{USAGE}")


def parser() -> argparse.ArgumentParser:
  p = Parser(prog="zoo", usage=USAGE)
  sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)
  sub.add_parser("list")
  show = sub.add_parser("show")
  show.add_argument("exp")
  show.add_argument("--mesh-rule", help="pick the mesh rule for this hardware name")
  show.add_argument("--topology", help="pick the mesh rule for this TPU topology (v5p-128)")
  show.add_argument(
    "--memory",
    action="store_true",
    help="compile the train step for this machine: its memory, the device's, what train.fit does",
  )
  plan = sub.add_parser("plan")
  plan.add_argument("exp")
  plan.add_argument("--topology", required=True, help="v5p-128, v5e-16, v5p:4x4x4, ...")
  for name in ("run", "eval"):
    s = sub.add_parser(name)
    s.add_argument("exp")
    s.add_argument("--workdir", required=True)
    s.add_argument("--mesh-rule", help="pick the mesh rule for this hardware name")
    if name == "run":
      s.add_argument("--quiet", action="store_true", help="no progress bar")
      # A supervisor (common/supervisor.py) runs the trainer as a child and reruns it.
      s.add_argument("--restarts", type=int, default=0, help="restart a failed or hung run")
    # Several hosts: one process each, as torchrun's flags (docs/parallel.md, "Several hosts").
    s.add_argument("--coordinator", help="HOST:PORT of process 0")
    s.add_argument("--num-processes", type=int)
    s.add_argument("--process-id", type=int)
  good = sub.add_parser("goodput")
  good.add_argument("--workdir", required=True)
  good.add_argument("--json", action="store_true", help="the figures as one JSON object")
  good.add_argument("--process", type=int, help="whose events (default: the lowest index)")
  gen = sub.add_parser("generate")
  gen.add_argument("--workdir", required=True)
  what = gen.add_mutually_exclusive_group()  # a language model's prompt, or a speech model's WAV
  what.add_argument("--prompt")
  what.add_argument("--audio", help="a WAV file to transcribe (a speech model's workdir)")
  # The decoder prompt of a converted checkpoint whose family has choices (Whisper's).
  gen.add_argument("--language", help="--audio: the language token (Whisper: en by default)")
  gen.add_argument("--task", help="--audio: transcribe (default) or translate")
  # An image model (DiT) takes the next ones instead.
  gen.add_argument("--labels", help="comma-separated class ids, one image each")
  gen.add_argument("--num-per-label", type=int, help="N images of every class")
  gen.add_argument("--out", help="the .npz file: images [N, H, W, C] in [0, 1], labels [N]")
  gen.add_argument("--guidance", type=float, help="classifier-free guidance (1: none)")
  gen.add_argument("--steps", type=int, help="sampling steps")
  gen.add_argument("--eta", type=float, help="DDIM's eta: 0 deterministic, 1 ancestral")
  gen.add_argument("--max-new-tokens", type=int, default=200)
  gen.add_argument("--temperature", type=float, help="0: greedy (default 0.8; --audio: 0)")
  gen.add_argument("--top-k", type=int, default=0)
  gen.add_argument("--top-p", type=float, default=1.0)
  gen.add_argument("--seed", type=int, default=0)
  talk = sub.add_parser("chat")
  talk.add_argument("--workdir", required=True)
  talk.add_argument("--messages", help="a JSON file of messages: print one answer and exit")
  talk.add_argument("--system", help="a system message to open the conversation with")
  talk.add_argument(
    "--tools",
    help="FILE.py:fn or module:fn, comma-separated: tools the model calls (docs/tools.md)",
  )
  talk.add_argument("--max-new-tokens", type=int, default=300)
  talk.add_argument("--temperature", type=float, help="0: greedy (default 0.8)")
  talk.add_argument("--top-k", type=int, default=0)
  talk.add_argument("--top-p", type=float, default=1.0)
  talk.add_argument("--seed", type=int, default=0)
  srv = sub.add_parser("serve")
  srv.add_argument("--workdir", required=True, help="a zoo run, a .gguf file or an HF directory")
  srv.add_argument("--host", default="127.0.0.1", help="the address to bind (0.0.0.0: every one)")
  srv.add_argument("--port", type=int, default=8000, help="0: a free port (printed)")
  srv.add_argument("--slots", type=int, default=8, help="requests decoded together")
  srv.add_argument("--max-len", type=int, help="tokens per slot (default: the model's, <= 2048)")
  srv.add_argument("--model-name", help="the name clients send (default: the workdir's)")
  srv.add_argument("--max-queue", type=int, default=64, help="requests waiting beyond the slots")
  srv.add_argument("--grace-s", type=float, default=30.0, help="SIGTERM: time to finish requests")
  srv.add_argument("--api-key", help="the key clients must send (Authorization: Bearer KEY)")
  srv.add_argument("--dtype", choices=["float32", "bfloat16"], help="compute in (default: saved)")
  data = sub.add_parser("data")
  data_sub = data.add_subparsers(dest="data_command", required=True, parser_class=Parser)
  prep = data_sub.add_parser("prepare")
  prep.add_argument("exp")
  prep.add_argument("--out", required=True, help="the prepared directory")
  prep.add_argument("--workers", type=int, default=0, help="worker processes (0: every core)")
  prep.add_argument("--num-processes", type=int, default=1, help="hosts sharing the work")
  prep.add_argument("--process-id", type=int, default=0, help="this host's index")
  prep.add_argument("--quiet", action="store_true", help="no progress bar")
  show_rows = data_sub.add_parser("show")
  show_rows.add_argument("exp")
  show_rows.add_argument("--split", default="train", choices=["train", "eval"])
  show_rows.add_argument("--rows", type=int, default=4)
  show_rows.add_argument("--json", action="store_true", help="one JSON object a row")
  bench = data_sub.add_parser("bench")
  bench.add_argument("exp")
  bench.add_argument("--batches", type=int, default=50, help="pipeline batches timed")
  bench.add_argument("--steps", type=int, default=5, help="train steps timed")
  conv = sub.add_parser("convert")
  conv.add_argument("format", choices=["hf", "gguf"])
  conv.add_argument("src")
  conv.add_argument("--out", required=True)
  conv.add_argument("--param-dtype", default="float32")
  exp = sub.add_parser("export")
  exp.add_argument("format", choices=["hf", "gguf"])
  exp.add_argument("--workdir", required=True)
  exp.add_argument("--out", required=True)
  exp.add_argument("--type", default="f32", help="gguf: f32, f16, bf16 or q8_0")
  harness = sub.add_parser("lm-eval")
  harness.add_argument("--workdir", required=True)
  harness.add_argument("--tasks", required=True, help="lm-eval task names, comma-separated")
  harness.add_argument("--include-path", help="a folder of more task YAML files")
  harness.add_argument("--num-fewshot", type=int)
  harness.add_argument("--limit", type=float, help="items per task (a fraction if below 1)")
  harness.add_argument("--batch-size", type=int, default=16)
  harness.add_argument("--output-path", help="the results JSON (DIR/lm_eval/results.json)")
  harness.add_argument(
    "--apply-chat-template",
    action="store_true",
    help="render each prompt with the model's chat template (lm-eval's --apply_chat_template)",
  )
  return p


def hardware(args) -> str:
  """The hardware name mesh rules match: --mesh-rule's, or the devices found."""
  from nnx_zoo.common import mesh

  return args.mesh_rule or mesh.hardware_name()


def cmd_list(_args, _overrides):
  from nnx_zoo.common import experiments
  from nnx_zoo.experiments import REGISTRY

  width = max(map(len, REGISTRY))
  for name in REGISTRY:
    print(f"{name:<{width}}  {experiments.describe(name)}")


def cmd_show(args, overrides):
  from nnx_zoo.common import experiments, models, tasks
  from nnx_zoo.common.nn import lora

  if args.topology:  # a TPU slice's hardware name, from the name alone (no libtpu needed)
    from nnx_zoo.common import plan

    args.mesh_rule = plan.parse_topology(args.topology).hardware
  cfg = experiments.get_config(args.exp, overrides, hardware=hardware(args))
  print(cfg)
  print(f"# model: {experiments.model_origin(cfg)}")
  print(f"# mesh rule: {cfg.mesh_rule}")
  _print_attention_impl(cfg, hardware(args))
  count = models.num_params(cfg.model)
  print(f"# parameters: {count:,} (computed abstractly, nothing allocated)")
  fixed = models.num_fixed(cfg.model)
  if fixed:  # Whisper's encoder sinusoids: transformers counts them as (frozen) parameters
    print(f"# with the fixed sinusoidal tables as weights (transformers' count): {count + fixed:,}")
  if cfg.model.get("mlp") and cfg.model.mlp.kind == "moe":  # CLIP's towers: no top-level mlp
    mlp = cfg.model.mlp
    print(
      f"# active per token: {models.num_active_params(cfg.model):,} ({mlp.top_k} of "
      f"{mlp.num_experts} experts)"
    )
    if mlp.capacity_factor:
      print(
        f"# capacity factor {mlp.capacity_factor}: tokens over an expert's capacity are DROPPED"
        " (their routed output is 0); 0 keeps every token (dropless)"
      )
  if cfg.model.get("lora") is not None and cfg.model.lora.rank:
    trained = models.num_params(cfg.model, lora.trainable(cfg.model))
    print(f"# trained: {trained:,} (LoRA adapters and model.lora.train; the rest frozen)")
  for line in tasks.of(cfg).show(cfg):  # what the task adds (distill: teacher and student)
    print(line)
  if args.memory:
    _print_memory(cfg)


def _print_memory(cfg):
  """The train step compiled for this machine's devices (never run): what it needs, what a
  device has, and what train.fit=auto would do (common/train/fit.py)."""
  from nnx_zoo.common.train import fit, optim, trainer

  layout = trainer.experiment_layout(cfg)
  tx = optim.optimizer(cfg.optim, cfg.train.steps)
  print(fit.report(cfg, tx=tx, layout=layout))


def _print_attention_impl(cfg, hardware_name: str):
  """What attention.impl="auto" runs on the hardware the config was resolved for (as the layer
  resolves it when the step is traced; a packed text batch of data.seq_len rows)."""
  from nnx_zoo.common import mesh
  from nnx_zoo.common.nn import attention_report

  seq_len = cfg.get("data", {}).get("seq_len", 0)
  if not seq_len or "attention" not in cfg.model:
    return
  platform = mesh.platform_of(hardware_name)
  resolved = attention_report.describe_auto(
    cfg.model, platform=platform, seq_len=seq_len, device_kind=hardware_name
  )
  if resolved:
    print(f"# attention.impl: auto -> {resolved}")


def cmd_plan(args, overrides):
  from nnx_zoo.common import plan

  cfg = plan.config(args.exp, args.topology, overrides)
  result = plan.plan(cfg, args.topology)
  print(plan.format(result))
  if not result["fits"]:  # exit 2, as every user error: the fix is in the message
    raise UserError(
      f"{args.exp} does not fit on {result['topology']}: try " + "; or ".join(result["fixes"])
    )


def cmd_run(args, overrides):
  from nnx_zoo.common import distributed, experiments
  from nnx_zoo.common.train import trainer

  distributed.initialize(args.coordinator, args.num_processes, args.process_id)
  cfg = experiments.get_config(args.exp, overrides, hardware=hardware(args))
  last = trainer.train(cfg, args.workdir, progress=not args.quiet)
  print(json.dumps({"workdir": args.workdir, **last}))


def cmd_eval(args, overrides):

  from nnx_zoo.common import distributed, experiments, tasks
  from nnx_zoo.common.hub import checkpoint, weights
  from nnx_zoo.common.train import metrics, trainer

  distributed.initialize(args.coordinator, args.num_processes, args.process_id)
  cfg = experiments.get_config(args.exp, overrides, hardware=hardware(args))
  # The experiment's mesh, as `zoo run` makes it (a row split over mesh.context stays split).
  layout = trainer.experiment_layout(cfg)
  if not checkpoint.has_steps(args.workdir) and cfg.init_from:
    # No run yet: the weights it would start from, the number a fine-tune is compared with.
    graphdef, params = weights.init_from_params(cfg, layout)
    step, evaluated = 0, "init_from"
  else:
    graphdef, params, step = weights.restore_params(cfg, args.workdir, layout)
    evaluated = "checkpoint"
  data = trainer.load_data(cfg, train=False, layout=layout)
  if data.eval is None:
    raise UserError(f"{args.exp} has no held-out split: set data.eval_files.")
  result = trainer.evaluate(
    params, data, graphdef=graphdef, cfg=cfg, layout=layout, check_memory=True
  )
  result.update(tasks.of(cfg).score(graphdef, params, cfg))  # a denoiser's samples, say
  os.makedirs(args.workdir, exist_ok=True)  # a base's evaluation: the run's log starts here
  log = metrics.MetricsLog(args.workdir)
  result["weights"] = evaluated  # the run's checkpoint, or (none yet) its init_from
  log.write(step, result, split="eval")
  log.close()
  print(json.dumps({"step": step, "split": "eval", **result}))


def cmd_goodput(args, _overrides):
  from nnx_zoo.common.train import goodput

  result = goodput.summary(args.workdir, process=args.process)
  print(json.dumps(result) if args.json else goodput.format(result, args.workdir))


def cmd_generate(args, _overrides):
  """What the run's task makes: text for a prompt, a transcript of --audio, images of
  --labels (common/tasks/)."""
  from nnx_zoo.common import tasks

  cfg = workdir_config(args)
  tasks.of(cfg).generate(args, cfg)


def cmd_chat(args, _overrides):
  """A language model's answers in a conversation, rendered with its run's chat template."""
  from nnx_zoo.common.tasks import language_model

  cfg = workdir_config(args)
  language_model.chat(args, cfg)


def cmd_serve(args, _overrides):
  """An OpenAI-compatible HTTP server over the engine (common/serve/, docs/serving.md)."""
  from nnx_zoo.common.serve import server

  server.serve(args)


def workdir_config(args):
  """The config.json of `--workdir`: a `zoo run` workdir, a `zoo convert` output, or a .gguf
  file, a Hugging Face directory or `tiny:NAME` (converted once into the zoo's cache, which then
  stands in for the workdir: `hub.weights.as_workdir`)."""
  from nnx_zoo.common.hub import weights

  args.workdir, cfg = weights.workdir_config(args.workdir)
  return cfg


def cmd_data(args, overrides):
  from nnx_zoo.common import experiments, report, tasks
  from nnx_zoo.common.data import prepare

  cfg = experiments.get_config(args.exp, overrides)
  if args.data_command == "prepare":
    result = prepare.prepare(
      cfg.data,
      args.out,
      workers=args.workers,
      num_processes=args.num_processes,
      process_id=args.process_id,
      progress=not args.quiet,
    )
    # What the task writes beside the tokens (distill: its teacher's top-k log-probabilities).
    result.update(
      tasks.of(cfg).after_prepare(
        cfg,
        args.out,
        num_processes=args.num_processes,
        process_id=args.process_id,
        progress=not args.quiet,
      )
    )
    print(json.dumps(result))
  elif args.data_command == "show":
    if args.rows < 1:
      raise UserError("--rows must be at least 1.")
    print(report.show(cfg, split=args.split, count=args.rows, as_json=args.json))
  else:
    print(json.dumps(report.bench(cfg, batches=args.batches, steps=args.steps)))


def cmd_convert(args, _overrides):
  from nnx_zoo.common import hub

  convert = hub.convert_gguf if args.format == "gguf" else hub.convert_hf
  print(json.dumps(convert(args.src, args.out, param_dtype=args.param_dtype)))


def cmd_export(args, _overrides):
  from nnx_zoo.common import hub

  if args.format == "gguf":
    print(json.dumps(hub.export_gguf(args.workdir, args.out, type=args.type)))
  else:
    print(json.dumps(hub.export_hf(args.workdir, args.out)))


def cmd_lm_eval(args, _overrides):
  from nnx_zoo.common import lm_eval

  lm_eval.run(
    args.workdir,
    [t.strip() for t in args.tasks.split(",") if t.strip()],
    include_path=args.include_path,
    num_fewshot=args.num_fewshot,
    limit=args.limit,
    batch_size=args.batch_size,
    output_path=args.output_path,
    apply_chat_template=args.apply_chat_template,
  )


def supervise(argv, args) -> int:
  """`zoo run ... --restarts N`: the run as a supervised child process (no jax here)."""
  from nnx_zoo.common import supervisor

  if args.restarts < 0:
    raise UserError(f"--restarts {args.restarts}: give how many times to rerun, 0 or more.")
  process = supervisor.process_index(args.process_id)
  return supervisor.supervise(argv, workdir=args.workdir, restarts=args.restarts, process=process)


COMMANDS = {
  "list": cmd_list,
  "show": cmd_show,
  "plan": cmd_plan,
  "run": cmd_run,
  "eval": cmd_eval,
  "goodput": cmd_goodput,
  "generate": cmd_generate,
  "chat": cmd_chat,
  "serve": cmd_serve,
  "data": cmd_data,
  "convert": cmd_convert,
  "export": cmd_export,
  "lm-eval": cmd_lm_eval,
}


# The environment variable that moves JAX's persistent compilation cache, or turns it off ("off").
COMPILATION_CACHE = "NNX_ZOO_COMPILATION_CACHE"
# Commands that start JAX's backends at once: quietly, so libtpu's C-level complaints on a host
# without a TPU (from the tpu and test extras) do not come before the answer. `run` and `eval`
# start them after jax.distributed.initialize (several hosts), quietly too (mesh.hardware_name).
STARTS_JAX = ("generate", "chat", "serve", "convert", "export", "lm-eval")


def start_jax(command: str):
  """JAX as every command uses it: compiled programs kept on disk (under the zoo's cache, or
  $NNX_ZOO_COMPILATION_CACHE; "off" keeps none), so a second `zoo chat` or `zoo generate` of the
  same model loads its programs instead of compiling them again."""
  import jax

  from nnx_zoo.common import files, mesh

  where = (
    os.environ.get(COMPILATION_CACHE, "")
    or os.environ.get("JAX_COMPILATION_CACHE_DIR", "")  # jax's own variable, where it is set
    or files.cache_dir("jax")
  )
  if where.lower() not in ("off", "0", "none"):
    jax.config.update("jax_compilation_cache_dir", where)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
  if command in STARTS_JAX:
    with mesh.quiet_stderr():
      jax.devices()


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  import absl.logging

  absl.logging.set_verbosity(absl.logging.ERROR)  # orbax's info lines drown the progress bar
  try:
    rest, overrides = split_overrides(argv)
    args = parser().parse_args(rest)
    if overrides and args.command in (
      "list",
      "goodput",
      "generate",
      "serve",
      "convert",
      "export",
      "lm-eval",
    ):
      raise UserError(f"`zoo {args.command}` takes no --config overrides.")
    if args.command == "run" and args.restarts:
      return supervise(argv, args)
    if args.command not in ("list", "goodput"):  # goodput reads files only
      start_jax(args.command)
    COMMANDS[args.command](args, overrides)
  except UserError as e:
    print(f"zoo: error: {e}", file=sys.stderr)
    return 2
  except Preempted as e:  # SIGTERM/SIGINT: a checkpoint is saved, rerunning resumes
    print(f"zoo: {e}", file=sys.stderr)
    return e.exit_code
  return 0


if __name__ == "__main__":
  sys.exit(main())
