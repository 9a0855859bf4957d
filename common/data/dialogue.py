"""The plays as dialogue: each scene cut into multi-turn conversations (one speaker the
assistant, the others the user, a system line naming the play, the scene and who speaks), and
preference pairs (the speaker's true reply against a reply of about its length from elsewhere
in the play). What `data.kind="shakespeare"` trains on with `data.format` "chat" or
"preference" (common/data/chat.py renders and tokenizes them)."""

import random
import re

# A scene's heading ("SCENE II. A room of state in the Castle.", "Scene 1"), a speech's speaker
# ("Hor.", "HORATIO.", "First Clown."), an act's heading, which is no speaker.
_SCENE = re.compile(r"^(scene)\s+([ivxlc]+|\d+)\b.*$", re.IGNORECASE)
_ACT = re.compile(r"^act\s+\S+", re.IGNORECASE)
_SPEAKER = re.compile(r"^([A-Z][A-Za-z'\- ]{0,30}?)\.$")


_SMALL = {"of", "the", "and", "a", "in"}


def budget(seq_len: int) -> int:
  """Characters of speech a conversation aims at for rows of `seq_len` tokens (bytes): three
  quarters of them, the chat template's tags and the system line filling the rest."""
  return seq_len * 3 // 4


def title(play: str) -> str:
  """The play's name from its file stem: `merry_wives_of_windsor` -> `Merry Wives of Windsor`,
  `henry_iv_part_1` -> `Henry IV Part 1`."""
  words = play.split("_")
  out = []
  for i, w in enumerate(words):
    if i and re.fullmatch(r"[ivxlc]+", w):
      out.append(w.upper())  # a regnal or part number
    elif i and w in _SMALL:
      out.append(w)
    else:
      out.append(w.capitalize())
  return " ".join(out)


def _act(line: str) -> str:
  """An act's heading as `Act IV` (`ACT IV.`, `ACT 4`, `ACT FIRST.` -> `Act First`)."""
  parts = line.rstrip(".").split(None, 1)
  number = parts[1] if len(parts) > 1 else ""
  if not re.fullmatch(r"[IVXLC]+|\d+", number):
    number = number.title()
  return f"Act {number}".strip()


def scenes(text: str) -> list[tuple[str, list[tuple[str, str]]]]:
  """(heading, [(speaker, speech), ...]) of every scene of a play's text: blocks between blank
  lines, a block whose first line is a speaker tag one speech (stage directions, the bracketed
  lines, left out)."""
  out, act, heading, speeches = [], "", None, []
  for block in re.split(r"\n\s*\n", text):
    lines = [ln.strip() for ln in block.strip().splitlines() if ln.strip()]
    if not lines:
      continue
    if _ACT.match(lines[0]):
      act = _act(lines[0])
      lines = lines[1:]  # "ACT 1" and "SCENE 1" may share a block
      if not lines:
        continue
    if _SCENE.match(lines[0]):
      if heading is not None and speeches:
        out.append((heading, speeches))
      scene = lines[0].rstrip(".")
      heading, speeches = (f"{act}, {scene}" if act else scene), []
      continue
    match = _SPEAKER.match(lines[0])
    if heading is None or match is None or _ACT.match(lines[0]) or len(lines) < 2:
      continue
    words = [ln for ln in lines[1:] if not (ln.startswith("[") or ln.endswith("]"))]
    if words:
      speeches.append((match.group(1).strip(), "\n".join(words)))
  if heading is not None and speeches:
    out.append((heading, speeches))
  return out


def conversations(play: str, text: str, *, budget: int) -> list[list[dict]]:
  """The scenes cut into conversations of consecutive speeches, at most `budget` characters
  where speeches are short enough, each ending with a speech of the speaker who is the
  assistant; that speaker's other speeches in it are assistant turns too, the others' speeches
  (named) the user's."""
  out = []
  for heading, speeches in scenes(text):
    windows, size = [[]], 0
    for speaker, speech in speeches:
      length = len(speaker) + len(speech) + 4
      if windows[-1] and size + length > budget:
        windows.append([])
        size = 0
      windows[-1].append((speaker, speech))
      size += length
    for window in windows:  # the scene's last one too
      messages = _messages(play, heading, window) if len(window) >= 2 else None
      if messages is not None:
        out.append(messages)
  return out


def _messages(play: str, heading: str, window: list[tuple[str, str]]) -> list[dict] | None:
  me = window[-1][0]
  turns: list[dict] = []
  for speaker, speech in window:
    if speaker == me:
      if turns and turns[-1]["role"] == "assistant":
        turns[-1]["content"] += "\n" + speech
      elif turns:  # a conversation opens with the others' words
        turns.append({"role": "assistant", "content": speech})
    elif turns and turns[-1]["role"] == "user":
      turns[-1]["content"] += f"\n{speaker}: {speech}"
    else:
      turns.append({"role": "user", "content": f"{speaker}: {speech}"})
  if len(turns) < 2 or turns[-1]["role"] != "assistant":
    return None
  system = {"role": "system", "content": f"{title(play)}, {heading}. You are {me}."}
  return [system, *turns]


def records(play: str, text: str, *, fmt: str, budget: int) -> list:
  """A play's records of `data.format` `fmt`: its conversations (chat), or its pairs
  (preference)."""
  make = preference_pairs if fmt == "preference" else conversations
  return make(play, text, budget=budget)


def _speaker(system: str) -> str:
  """The assistant's name in a conversation's system line (`... You are HORATIO.`)."""
  return system.rsplit("You are ", 1)[-1].rstrip(".")


def preference_pairs(play: str, text: str, *, budget: int, seed: int = 0) -> list[dict]:
  """{"prompt", "chosen", "rejected"} of each conversation: the prompt up to its last assistant
  turn, the true reply, and a speech of about the same length by another speaker (the closest
  in length of 8 drawn from the play's speeches of at least 10 characters by others): a speech
  that is some pair's true reply is another's rejected one only where someone else says it, so
  what tells them apart is the scene and the speaker the system line names."""
  rng = random.Random(f"{seed}:{play}")
  pool = [(who, s) for _, speeches in scenes(text) for who, s in speeches if len(s) >= 10]
  pairs = []
  for messages in conversations(play, text, budget=budget):
    chosen, me = messages[-1]["content"], _speaker(messages[0]["content"])
    drawn = rng.sample(pool, min(16, len(pool)))
    candidates = [s for who, s in drawn if who != me and s != chosen][:8]
    if not candidates:
      continue
    rejected = min(candidates, key=lambda s: abs(len(s) - len(chosen)))
    pairs.append({"prompt": messages[:-1], "chosen": chosen, "rejected": rejected})
  return pairs
