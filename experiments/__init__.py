"""The experiment catalogue: registered name -> module. `zoo list` shows it."""

REGISTRY = {
    "lm/shakespeare-char": "experiments.lm.shakespeare_char",
    "lm/shakespeare-bpe": "experiments.lm.shakespeare_bpe",
    "lm/shakespeare-moe": "experiments.lm.shakespeare_moe",
    "lm/llama2-7b": "experiments.lm.llama2_7b",
    "lm/llama3-8b": "experiments.lm.llama3_8b",
    "lm/mistral-7b": "experiments.lm.mistral_7b",
    "lm/qwen3-0.6b": "experiments.lm.qwen3_0_6b",
    "lm/mixtral-8x7b": "experiments.lm.mixtral_8x7b",
    "lm/qwen3-30b-a3b": "experiments.lm.qwen3_30b_a3b",
    "lm/gemma2-2b": "experiments.lm.gemma2_2b",
    "lm/gemma3-1b": "experiments.lm.gemma3_1b",
    "lm/shakespeare-finetune": "experiments.lm.shakespeare_finetune",
    "text/minilm-shakespeare-genre": "experiments.text.minilm_shakespeare_genre",
    "bench/llama-19m": "experiments.bench.llama_19m",
    "seq2seq/shakespeare-spans": "experiments.seq2seq.shakespeare_spans",
    "seq2seq/t5-small": "experiments.seq2seq.t5_small",
    "vision/vit-digits": "experiments.vision.vit_digits",
    "vision/clip-digits": "experiments.vision.clip_digits",
    "vision/vit-b16": "experiments.vision.vit_b16",
    "vision/clip-vit-b32": "experiments.vision.clip_vit_b32",
}
DEFAULT = "lm/shakespeare-char"
