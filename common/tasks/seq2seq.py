"""The sequence-to-sequence task: an encoder-decoder's cross-entropy on target tokens given
source tokens (T5's span corruption); `zoo generate` writes the decoder's output for a prompt."""

import numpy as np

from nnx_zoo.common import tasks
from nnx_zoo.common.errors import UserError
from nnx_zoo.common.tasks import language_model, losses


class Seq2Seq(tasks.Task):
  name = "seq2seq"

  def loss_sums(self, model, batch, *, loss_chunk=0):
    return losses.seq2seq_sums(model, batch, loss_chunk=loss_chunk)

  summary = language_model.LanguageModel.summary

  def generate(self, args, cfg):
    from nnx_zoo.common import engine
    from nnx_zoo.common.data import spans, tokenizers
    from nnx_zoo.common.hub import weights

    language_model.check_prompt(args, cfg)
    graphdef, params, _ = weights.restore_params(cfg, args.workdir)
    tokenizer = tokenizers.load(cfg.data.tokenizer)
    # The prompt is the encoder's input; the decoder writes the output.
    extra = cfg.data.get("extra_ids", 0)  # absent in a `zoo convert` output: T5's tokenizer
    vocab = tokenizer.vocab_size + extra
    prompt = spans.encode_prompt(args.prompt, tokenizer, vocab, extra)
    if tokenizer.eos_id is not None:  # T5's inputs end with EOS
      prompt = np.append(prompt, tokenizer.eos_id)
    if len(prompt) == 0:
      raise UserError("The prompt is empty: give --prompt TEXT.")
    options = language_model.sampling_options(args)
    out = engine.generate_seq2seq((graphdef, params), prompt[None], **options)[0].tolist()
    if tokenizer.eos_id in out:
      out = out[: out.index(tokenizer.eos_id)]
    print(spans.decode_output(out, tokenizer, vocab, extra))


tasks.register(Seq2Seq())
