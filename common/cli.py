"""The `zoo` command: list, show, run, eval, generate. See DESIGN.md for the contract."""

import argparse
import json
import os
import sys

from common.errors import UserError

USAGE = """\
zoo list                                          # the experiments, one line each
zoo show EXP [--config.KEY=VALUE ...]             # the resolved config and parameter count
zoo run  EXP --workdir DIR [--config.KEY=VALUE ...]   # train; resumes if DIR has a checkpoint
zoo eval EXP --workdir DIR [--config.KEY=VALUE ...]   # held-out loss of DIR's latest checkpoint
zoo generate --workdir DIR --prompt TEXT [--max-new-tokens N --temperature T --top-k K --top-p P]

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
  for name in ("run", "eval"):
    s = sub.add_parser(name)
    s.add_argument("exp")
    s.add_argument("--workdir", required=True)
    if name == "run":
      s.add_argument("--quiet", action="store_true", help="no progress bar")
  gen = sub.add_parser("generate")
  gen.add_argument("--workdir", required=True)
  gen.add_argument("--prompt", required=True)
  gen.add_argument("--max-new-tokens", type=int, default=200)
  gen.add_argument("--temperature", type=float, default=0.8)
  gen.add_argument("--top-k", type=int, default=0)
  gen.add_argument("--top-p", type=float, default=1.0)
  gen.add_argument("--seed", type=int, default=0)
  return p


def cmd_list(_args, _overrides):
  from common import experiments
  from experiments import REGISTRY

  width = max(map(len, REGISTRY))
  for name in REGISTRY:
    print(f"{name:<{width}}  {experiments.describe(name)}")


def cmd_show(args, overrides):
  from common import experiments, models

  cfg = experiments.get_config(args.exp, overrides)
  print(cfg)
  print(f"# parameters: {models.num_params(cfg.model):,} (computed abstractly, nothing allocated)")


def cmd_run(args, overrides):
  from common import experiments, trainer

  cfg = experiments.get_config(args.exp, overrides)
  last = trainer.train(cfg, args.workdir, progress=not args.quiet)
  print(json.dumps({"workdir": args.workdir, **last}))


def cmd_eval(args, overrides):
  from common import data, experiments, tokenizers, trainer

  cfg = experiments.get_config(args.exp, overrides)
  graphdef, params, step = trainer.restore_params(cfg, args.workdir)
  rows = data.load_split(cfg.data, "eval", tokenizers.load(cfg.data.tokenizer))
  if rows is None:
    raise UserError(f"{args.exp} has no held-out split: set data.eval_files.")
  result = trainer.evaluate(params, rows, graphdef=graphdef, cfg=cfg)
  log = trainer.MetricsLog(args.workdir)
  log.write(step, result, split="eval")
  log.close()
  print(json.dumps({"step": step, "split": "eval", **result}))


def cmd_generate(args, _overrides):
  import jax

  from common import config as config_lib
  from common import sampling, tokenizers, trainer

  path = os.path.join(args.workdir, "config.json")
  if not os.path.exists(path):
    raise UserError(f"{args.workdir} has no config.json: give the --workdir of a `zoo run`.")
  with open(path) as f:
    cfg = config_lib.from_json(f.read())
  graphdef, params, _ = trainer.restore_params(cfg, args.workdir)
  tokenizer = tokenizers.load(cfg.data.tokenizer)
  prompt = tokenizer.encode(args.prompt)
  if len(prompt) == 0:
    raise UserError("The prompt is empty: give --prompt TEXT.")
  out = sampling.generate(
    (graphdef, params),
    prompt[None],
    max_new_tokens=args.max_new_tokens,
    rng=jax.random.key(args.seed),
    temperature=args.temperature,
    top_k=args.top_k,
    top_p=args.top_p,
  )
  print(tokenizer.decode(out[0].tolist()))


COMMANDS = {
  "list": cmd_list,
  "show": cmd_show,
  "run": cmd_run,
  "eval": cmd_eval,
  "generate": cmd_generate,
}


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  import absl.logging

  absl.logging.set_verbosity(absl.logging.ERROR)  # orbax's info lines drown the progress bar
  try:
    rest, overrides = split_overrides(argv)
    args = parser().parse_args(rest)
    if overrides and args.command in ("list", "generate"):
      raise UserError(f"`zoo {args.command}` takes no --config overrides.")
    COMMANDS[args.command](args, overrides)
  except UserError as e:
    print(f"zoo: error: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
