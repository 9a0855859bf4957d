"""Goodput: a run's wall time across every attempt, split into productive training and badput by
cause, read back from WORKDIR/events/ (common/train/events.py); `zoo goodput` prints it.
docs/goodput.md defines every figure and compares them with ml-goodput-measurement's.
"""

import glob
import heapq
import json
import os
import re

import numpy as np

from nnx_zoo.common.errors import UserError

# What each second of an attempt was spent on. Where two overlap, the one listed first wins:
# a compilation inside a step or a restore counts as compilation, a batch fetched inside a step
# as data wait, and a step's remaining time as goodput (or wasted progress where the step was
# done again later).
LABELS = (
  "compile",
  "data",
  "checkpoint_save",
  "checkpoint_restore",
  "eval",
  "goodput",
  "wasted",
  "initialization",
  "prep",
  "other",
)
BADPUT = (
  "initialization",
  "prep",
  "compile",
  "data",
  "checkpoint_save",
  "checkpoint_restore",
  "eval",
  "wasted",
  "downtime",
  "other",
)
NAMES = {
  "initialization": "start-up: to the devices",
  "prep": "start-up: training prep",
  "compile": "compilation",
  "data": "data wait",
  "checkpoint_save": "checkpoint save",
  "checkpoint_restore": "checkpoint restore",
  "eval": "evaluation",
  "wasted": "progress lost (redone)",
  "downtime": "downtime (no process)",
  "other": "other",
}


def read(path: str) -> list[dict]:
  """The complete JSON lines of one events file (a line cut short by a kill is left out)."""
  out = []
  with open(path) as f:
    for line in f:
      try:
        out.append(json.loads(line))
      except json.JSONDecodeError:
        continue
  return out


def attempts(lines: list[dict]) -> list[list[dict]]:
  """One process's lines grouped by attempt, the attempts in the order they started."""
  groups: dict[str, list[dict]] = {}
  for line in lines:
    groups.setdefault(line["attempt"], []).append(line)
  return sorted(groups.values(), key=lambda g: _begin(g))


def _begin(lines: list[dict]) -> float:
  start = next((x for x in lines if x["event"] == "start"), None)
  if start is not None:
    return start.get("started", start["t"])
  return min(x["t"] - x.get("seconds", 0.0) for x in lines)


def _end(lines: list[dict]) -> float:
  return max(x["t"] for x in lines)


def _spans(
  attempt: list[dict], wasted: set[int], *, after: float | None = None
) -> list[tuple[float, float, str]]:
  """The labelled intervals of one attempt, from its start (not before `after`) to its last
  line; `wasted`: the ids of its step lines done again later."""
  begin, end = _begin(attempt), _end(attempt)
  if after is not None:
    begin = max(begin, after)
  out = [(begin, end, "other")]
  backend = next((x["t"] for x in attempt if x["event"] == "backend"), None)
  steps = [x for x in attempt if x["event"] == "step"]
  first = min((x["start"] for x in steps), default=end)
  out.append((begin, backend if backend is not None else first, "initialization"))
  if backend is not None:
    out.append((backend, first, "prep"))
  for x in attempt:
    kind = x["event"]
    if kind == "step":
      label = "wasted" if id(x) in wasted else "goodput"
      out.append((x["start"], x["start"] + x["seconds"], label))
      out.append((x["start"], x["start"] + x["data"], "data"))
    elif kind == "compile":
      out.append((x["t"] - x["seconds"], x["t"], "compile"))
    elif kind == "checkpoint":
      out.append((x["t"] - x["seconds"], x["t"], "checkpoint_save"))
    elif kind == "restore" and x["step"]:
      out.append((x["t"] - x["seconds"], x["t"], "checkpoint_restore"))
    elif kind == "eval":
      out.append((x["t"] - x["seconds"], x["t"], "eval"))
  clipped = [(max(lo, begin), min(hi, end), label) for lo, hi, label in out]
  return [(lo, hi, label) for lo, hi, label in clipped if hi > lo]


def split(spans: list[tuple[float, float, str]]) -> dict[str, float]:
  """Seconds per label, each instant given to the first label of LABELS that covers it."""
  rank = {label: i for i, label in enumerate(LABELS)}
  marks = sorted(
    [(lo, 1, rank[label]) for lo, _, label in spans]
    + [(hi, -1, rank[label]) for _, hi, label in spans]
  )
  counts = [0] * len(LABELS)
  heap: list[int] = []  # ranks with a positive count (lazily cleaned)
  out = dict.fromkeys(LABELS, 0.0)
  last = None
  for t, delta, r in marks:
    while heap and counts[heap[0]] == 0:
      heapq.heappop(heap)
    if last is not None and heap and t > last:
      out[LABELS[heap[0]]] += t - last
    counts[r] += delta
    if delta > 0:
      heapq.heappush(heap, r)
    last = t
  return out


def summary(workdir: str, *, process: int | None = None) -> dict:
  """The run's figures (docs/goodput.md), from the events of `process` (the lowest found by
  default: the processes of a job take the same steps together)."""
  paths = {
    int(m.group(1)): p
    for p in glob.glob(os.path.join(workdir, "events", "p*.jsonl"))
    if (m := re.fullmatch(r"p(\d+)\.jsonl", os.path.basename(p)))
  }
  if not paths:
    raise UserError(
      f"{os.path.join(workdir, 'events')} holds no events: give the --workdir of a `zoo run` "
      "(runs started before events were recorded have none)."
    )
  if process is None:
    process = min(paths)
  if process not in paths:
    raise UserError(f"No events of process {process} in {workdir}: it has {sorted(paths)}.")
  result = of_attempts(attempts(read(paths[process])))
  result["process"] = process
  result["restarts"] = restarts(workdir)
  return result


def of_attempts(runs: list[list[dict]]) -> dict:
  """The figures of one process's attempts (`attempts`), in seconds and shares of the wall."""
  # A step instance is productive if no later attempt computed the same step again.
  instances = [x for run in runs for x in run if x["event"] == "step"]
  last = {x["step"]: id(x) for x in instances}  # the attempts are in order
  wasted = {id(x) for x in instances if last[x["step"]] != id(x)}
  seconds = dict.fromkeys((*LABELS, "downtime"), 0.0)
  for i, run in enumerate(runs):
    # One process's attempts follow each other: a start time read a little early (a clock
    # step) is taken as the previous attempt's end.
    after = _end(runs[i - 1]) if i else None
    for label, value in split(_spans(run, wasted, after=after)).items():
      seconds[label] += value
    if i:
      seconds["downtime"] += max(_begin(run) - after, 0.0)
  wall = _end(runs[-1]) - _begin(runs[0]) if runs else 0.0
  productive = [x for x in instances if id(x) not in wasted]
  return {
    "wall_s": wall,
    "wall_h": wall / 3600,
    "goodput_s": seconds["goodput"],
    "goodput_h": seconds["goodput"] / 3600,
    "goodput": seconds["goodput"] / wall if wall else 0.0,
    "badput_s": {k: seconds[k] for k in BADPUT},
    "badput": {k: seconds[k] / wall if wall else 0.0 for k in BADPUT},
    "steps": len(productive),
    "steps_redone": len(wasted),
    "attempts": [
      {
        "attempt": run[0]["attempt"],
        "begin": _begin(run),
        "end": _end(run),
        "how": next((x["how"] for x in run if x["event"] == "end"), "killed"),
        "resumed_from": next((x["step"] for x in run if x["event"] == "restore"), None),
        "steps": sum(x["event"] == "step" for x in run),
      }
      for run in runs
    ],
    "step_time": step_time(productive, [x for run in runs for x in run if x["event"] == "compile"]),
  }


def step_time(steps: list[dict], compiles: list[dict]) -> dict:
  """The step-time deviation, as ml-goodput-measurement defines it: the ideal step time is the
  mean of the step times within median + 3 x MAD, and each step deviates from it by its time
  less the ideal. Steps that held a compilation (the first of each attempt) are left out."""
  spans = sorted((c["t"] - c["seconds"], c["t"]) for c in compiles)
  starts = [lo for lo, _ in spans]

  def compiled(x) -> bool:
    i = np.searchsorted(starts, x["start"] + x["seconds"])
    return any(hi > x["start"] for _, hi in spans[:i])

  times = np.asarray([x["seconds"] for x in steps if not compiled(x)], np.float64)
  if not len(times):
    return {"steps": 0}
  median = float(np.median(times))
  mad = float(np.median(np.abs(times - median)))
  normal = times[times <= median + 3 * mad]
  ideal = float(np.mean(normal))
  deviation = times - ideal
  return {
    "steps": len(times),
    "ideal_s": ideal,
    "median_s": median,
    "mad_s": mad,
    "mean_abs_deviation_s": float(np.mean(np.abs(deviation))),
    "max_deviation_s": float(np.max(deviation)),
    "anomalous": int(np.sum(times > median + 3 * mad)),
  }


def restarts(workdir: str) -> list[dict]:
  """The supervisors' restart records (events/supervisor-p*.jsonl), in time order."""
  out = []
  for path in sorted(glob.glob(os.path.join(workdir, "events", "supervisor-p*.jsonl"))):
    out += [x for x in read(path) if x.get("event") == "restart"]
  return sorted(out, key=lambda x: x["t"])


def format(result: dict, workdir: str) -> str:
  """`zoo goodput`'s table."""
  wall = result["wall_s"]
  n = len(result["attempts"])
  lines = [
    f"{workdir}: {n} attempt{'s' * (n != 1)} (process {result['process']}'s events)",
    f"  {'wall time':<26} {wall / 3600:8.3f} h  {wall:10.1f} s",
    f"  {'goodput':<26} {result['goodput_h']:8.3f} h  {result['goodput_s']:10.1f} s  "
    f"{100 * result['goodput']:5.1f}%  ({result['steps']} steps kept)",
    "  badput:",
  ]
  for key in BADPUT:
    s = result["badput_s"][key]
    note = f"  ({result['steps_redone']} steps done again)" if key == "wasted" else ""
    lines.append(f"    {NAMES[key]:<24} {s:21.1f} s  {100 * result['badput'][key]:5.1f}%{note}")
  st = result["step_time"]
  if st.get("steps"):
    lines.append(
      f"  step time: ideal {st['ideal_s']:.4f} s (mean within median + 3 MAD, {st['steps']} "
      f"steps), mean |deviation| {st['mean_abs_deviation_s']:.4f} s, max "
      f"+{st['max_deviation_s']:.4f} s, {st['anomalous']} anomalous"
    )
  for a in result["attempts"]:
    lines.append(
      f"  attempt {a['attempt']}: from step {a['resumed_from'] or 0}, {a['steps']} steps, "
      f"{a['end'] - a['begin']:.1f} s, {a['how']}"
    )
  for r in result["restarts"]:
    lines.append(
      f"  restart {r.get('attempt')} of process {r.get('process')}: {r.get('cause')}, resumed "
      f"from step {r.get('resumed_from')}"
    )
  return "\n".join(lines)


def scalars(result: dict) -> dict:
  """The figures TensorBoard gets (process 0, at the end of a run)."""
  out = {"goodput": result["goodput"], "goodput_h": result["goodput_h"], "wall_h": result["wall_h"]}
  out.update({f"badput/{k}": v for k, v in result["badput"].items()})
  if result["step_time"].get("steps"):
    out["step_time_ideal_s"] = result["step_time"]["ideal_s"]
    out["step_time_mean_abs_deviation_s"] = result["step_time"]["mean_abs_deviation_s"]
  return out
