"""The speech task: an encoder-decoder's cross-entropy on the words of log-mel frames (Whisper);
evaluated by loss and the data's word error rate; `zoo generate --audio` transcribes a WAV file,
one window at a time where it is longer than the model's window."""

from collections.abc import Callable

import jax
import numpy as np

from nnx_zoo.common import files, tasks
from nnx_zoo.common.data import audio
from nnx_zoo.common.errors import UserError
from nnx_zoo.common.tasks import losses


def transcript(
  clip: np.ndarray,
  *,
  seconds: float,
  transcribe: Callable[[np.ndarray], tuple[str, bool]],
  limit: int,
) -> str:
  """The transcript of mono 16 kHz audio, window by window (each cut at its quietest point near
  the window's end: audio.windows), joined in order. `transcribe(samples)` is one window's text
  and whether it ended (its end token written within `limit` tokens): one that did not may be
  cut short, which is said on stderr rather than passed over."""
  spans = audio.windows(clip, seconds=seconds)
  texts = []
  for start, end in spans:
    text, ended = transcribe(clip[start:end])
    if not ended:
      at = f" of {start / audio.SAMPLE_RATE:.2f}-{end / audio.SAMPLE_RATE:.2f} s" * (len(spans) > 1)
      files.warn(
        f"the transcript{at} reached the decoder's limit of {limit} tokens without its end "
        "token: it may be cut short."
      )
    texts.append(text)
  return " ".join(t for t in texts if t)


class Speech(tasks.Task):
  name = "speech"

  def loss_sums(self, model, batch, *, loss_chunk=0):
    return losses.seq2seq_sums(model, batch, loss_chunk=loss_chunk)

  def summary(self, sums):  # the data kind's score adds the word error rate
    count = max(sums["count"], 1.0)
    return {"loss": sums["total"] / count, "targets": int(count)}

  def generate(self, args, cfg):
    """The transcript of a WAV file, greedy unless --temperature says otherwise: a speech
    experiment's run (its own word list), or a converted checkpoint (its generation_config.json's
    prompt, its tokenizer)."""
    from nnx_zoo.common import engine
    from nnx_zoo.common.data import speech, tokenizers
    from nnx_zoo.common.hub import generation, weights

    if args.audio is None:
      raise UserError(f"{args.workdir} holds a speech model: give it --audio FILE.wav.")
    hf_generation = generation.read(args.workdir)
    if hf_generation is None and cfg.data.get("kind") not in speech.KINDS:
      raise UserError(
        f"{args.workdir} has neither a word list to write its tokens with (data.kind "
        f"{cfg.data.get('kind')!r}) nor a {generation.FILE}: --audio reads the workdir of a "
        "speech experiment or a `zoo convert hf` output of a Whisper directory."
      )
    if hf_generation is None:  # a speech experiment's run: its word list, its start token
      if args.language is not None or args.task is not None:
        raise UserError(
          f"{args.workdir} is a speech experiment's run: it takes no --language/--task."
        )
      settings = generation.Settings(
        decoder_prompt=(cfg.model.decoder_start_id,), eos_ids=(speech.END,)
      )
      decode = speech.decode
    else:  # a converted checkpoint: transformers' prompt and suppressed tokens, its tokenizer
      settings = generation.settings(
        cfg.model.family,
        hf_generation,
        config=cfg.get("source", {}).get("config", {}),
        language=args.language,
        task=args.task,
      )
      if not cfg.data.tokenizer.path:
        raise UserError(f"{args.workdir} has no tokenizer files to write the transcript with.")
      tokenizer = tokenizers.load(cfg.data.tokenizer)

      def decode(ids):  # up to the end token, without the tokenizer's special tokens
        return tokenizer.decode(generation.until_eos(ids, settings.eos_ids)).strip()

    # The model's window: its encoder positions times the stem's strides, at 100 frames a second
    # (a converted Whisper: 30 s, every window padded to it, as WhisperFeatureExtractor does).
    # Longer audio is heard window by window.
    frames = cfg.model.position.max_len * int(np.prod(cfg.model.stem_strides))
    seconds = min(cfg.data.get("seconds", frames / 100), frames / 100)
    clip = audio.read_wav(args.audio)
    graphdef, params, _ = weights.restore_params(cfg, args.workdir)
    # The decoder's positions hold the prompt and the new tokens but the last.
    room = cfg.model.decoder_position.max_len - len(settings.decoder_prompt) + 1
    limit = min(args.max_new_tokens, room)

    def transcribe(samples):
      features = audio.log_mel(samples, num_mels=cfg.model.channels, seconds=seconds)
      out = engine.generate_seq2seq(
        (graphdef, params),
        features[None],
        max_new_tokens=limit,
        rng=jax.random.key(args.seed),
        decoder_prompt=list(settings.decoder_prompt),
        suppress_ids=settings.suppress_ids,
        begin_suppress_ids=settings.begin_suppress_ids,
        temperature=args.temperature or 0.0,
        top_k=args.top_k,
        top_p=args.top_p,
      )
      ids = np.asarray(out[0])
      return decode(ids), bool(np.isin(ids, settings.eos_ids).any())

    print(transcript(clip, seconds=seconds, transcribe=transcribe, limit=limit))


tasks.register(Speech())
