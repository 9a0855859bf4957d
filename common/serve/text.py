"""Token ids to text as they come, and stop strings: what the server does between engine steps
(the engine works in token ids)."""


class Detokenizer:
  """The text of a stream of token ids, a token at a time. Each token's text is the difference
  between decoding a short window of the last tokens with it and without it (a tokenizer that
  drops a leading space, or merges bytes, decodes the window as it would the whole); a token that
  ends inside a UTF-8 character gives "" until the character is whole."""

  def __init__(self, tokenizer):
    self.decode = tokenizer.decode
    self.ids: list[int] = []
    self.text = ""
    self.offsets: list[int] = []  # each token's first character in `text`
    self._prefix = 0  # the window: ids[_prefix:] decoded, less ids[_prefix:_read]
    self._read = 0

  def add(self, token: int) -> str:
    self.ids.append(int(token))
    self.offsets.append(len(self.text))
    return self._read_new(final=False)

  def flush(self) -> str:
    """At the end: what the last tokens make even if a character is left unfinished (as
    decoding them all would: U+FFFD)."""
    return self._read_new(final=True)

  def _read_new(self, *, final: bool) -> str:
    before = self.decode(self.ids[self._prefix : self._read])
    after = self.decode(self.ids[self._prefix :])
    if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
      return ""
    new = after[len(before) :]
    self._prefix, self._read = self._read, len(self.ids)
    self.text += new
    return new


def find_stop(text: str, stops: tuple[str, ...], start: int = 0) -> int | None:
  """Where the first stop string begins in `text` (searching from `start`), or None."""
  found = [i for i in (text.find(s, start) for s in stops if s) if i >= 0]
  return min(found) if found else None


def held_back(text: str, stops: tuple[str, ...]) -> int:
  """How many characters at the end of `text` may begin a stop string: a stream sends them only
  once it knows they are not one."""
  longest = 0
  for stop in stops:
    for n in range(min(len(stop) - 1, len(text)), longest, -1):
      if text.endswith(stop[:n]):
        longest = n
        break
  return longest
