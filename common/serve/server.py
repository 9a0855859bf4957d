"""The `zoo serve` process: uvicorn bound first, the model loaded behind it (/health answers 503
until it is ready), and on SIGTERM (or Ctrl-C) no new request taken, those in flight finished
within the grace period, exit 0."""

import contextlib
import os
import signal
import sys
import threading

import uvicorn

from nnx_zoo.common.errors import UserError
from nnx_zoo.common.hub import weights
from nnx_zoo.common.serve import app as app_lib
from nnx_zoo.common.serve import model as model_lib


def say(message: str):
  print(f"zoo serve: {message}", file=sys.stderr, flush=True)


class Server(uvicorn.Server):
  """uvicorn's server, whose SIGTERM and SIGINT drain the service and end the process with 0
  (uvicorn's own handlers raise the signal again once it has stopped)."""

  def __init__(self, config: uvicorn.Config, service: app_lib.Service):
    super().__init__(config)
    self.service = service

  @contextlib.contextmanager
  def capture_signals(self):
    if threading.current_thread() is not threading.main_thread():
      yield
      return

    def handle(sig, _frame):
      if self.should_exit and sig == signal.SIGINT:
        self.force_exit = True  # a second Ctrl-C: stop waiting
      if self.service.state != "failed":
        self.service.state = "draining"  # new requests: 503
      self.should_exit = True
      say(
        f"{signal.Signals(sig).name}: draining (at most {self.config.timeout_graceful_shutdown} s)"
      )

    handled = (signal.SIGTERM, signal.SIGINT)
    before = {sig: signal.signal(sig, handle) for sig in handled}
    try:
      yield
    finally:
      for sig, handler in before.items():
        signal.signal(sig, handler)

  async def startup(self, sockets=None):
    await super().startup(sockets)
    for server in self.servers:
      for sock in server.sockets:
        host, port = sock.getsockname()[:2]
        say(f"listening on http://{host}:{port} (model {self.service.name!r})")


def check(args):
  """The options, checked before anything is bound or loaded."""
  for flag, value, low in (("--slots", args.slots, 1), ("--max-queue", args.max_queue, 0),
                           ("--grace-s", args.grace_s, 0), ("--port", args.port, 0)):  # fmt: skip
    if value < low:
      raise UserError(f"{flag} {value}: give at least {low}.")
  if args.max_len is not None and args.max_len < 2:
    raise UserError(f"--max-len {args.max_len}: give at least 2 tokens.")
  workdir = args.workdir
  if not (os.path.exists(workdir) or workdir.startswith("tiny:") or workdir.startswith("pkg:")):
    raise UserError(
      f"--workdir {workdir!r} does not exist: give a zoo run, a .gguf file or an HF dir."
    )


def serve(args) -> int:
  """Runs the server until SIGTERM; returns the exit code."""
  check(args)
  name = args.model_name or model_lib.name_of(args.workdir)

  def load():
    workdir, cfg = weights.workdir_config(args.workdir)
    served = model_lib.load(cfg, workdir, slots=args.slots, max_len=args.max_len, dtype=args.dtype)
    model_lib.warm(served)
    say(f"ready: {served.engine.slots} slots of {served.max_len} tokens")
    return served

  service = app_lib.Service(load, name=name, api_key=args.api_key, max_queue=args.max_queue)
  config = uvicorn.Config(
    app_lib.create(service),
    host=args.host,
    port=args.port,
    timeout_graceful_shutdown=args.grace_s,
    log_config=None,  # uvicorn leaves logging as it is: its warnings and errors reach stderr
    log_level="warning",
    access_log=False,
    lifespan="on",
  )
  server = Server(config, service)

  def failed(_error):
    server.should_exit = True

  service.on_failure = failed
  say(f"loading {args.workdir}")
  server.run()
  if service.error is not None:
    if isinstance(service.error, UserError):
      raise service.error
    raise UserError(f"loading failed: {type(service.error).__name__}: {service.error}")
  if not service.loaded.is_set():  # stopped while loading: do not wait for the weights
    say("stopped before the model was ready")
    sys.stderr.flush()
    os._exit(0)
  say("stopped")
  return 0
