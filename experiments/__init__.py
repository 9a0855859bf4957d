"""The experiment catalogue: registered name -> module. `zoo list` shows it."""

REGISTRY = {
    "lm/shakespeare-char": "nnx_zoo.experiments.lm.shakespeare_char",
    "lm/shakespeare-bpe": "nnx_zoo.experiments.lm.shakespeare_bpe",
    "lm/shakespeare-moe": "nnx_zoo.experiments.lm.shakespeare_moe",
    "lm/llama2-7b": "nnx_zoo.experiments.lm.llama2_7b",
    "lm/llama3-8b": "nnx_zoo.experiments.lm.llama3_8b",
    "lm/mistral-7b": "nnx_zoo.experiments.lm.mistral_7b",
    "lm/qwen3-0.6b": "nnx_zoo.experiments.lm.qwen3_0_6b",
    "lm/mixtral-8x7b": "nnx_zoo.experiments.lm.mixtral_8x7b",
    "lm/qwen3-30b-a3b": "nnx_zoo.experiments.lm.qwen3_30b_a3b",
    "lm/gemma2-2b": "nnx_zoo.experiments.lm.gemma2_2b",
    "lm/gemma3-1b": "nnx_zoo.experiments.lm.gemma3_1b",
    "lm/shakespeare-finetune": "nnx_zoo.experiments.lm.shakespeare_finetune",
    "chat/shakespeare-dialogue": "nnx_zoo.experiments.chat.shakespeare_dialogue",
    "chat/shakespeare-dialogue-dpo": "nnx_zoo.experiments.chat.shakespeare_dialogue_dpo",
    "text/minilm-shakespeare-genre": "nnx_zoo.experiments.text.minilm_shakespeare_genre",
    "bench/llama-19m": "nnx_zoo.experiments.bench.llama_19m",
    "seq2seq/shakespeare-spans": "nnx_zoo.experiments.seq2seq.shakespeare_spans",
    "seq2seq/t5-small": "nnx_zoo.experiments.seq2seq.t5_small",
    "vision/vit-digits": "nnx_zoo.experiments.vision.vit_digits",
    "vision/clip-digits": "nnx_zoo.experiments.vision.clip_digits",
    "vision/vit-b16": "nnx_zoo.experiments.vision.vit_b16",
    "vision/clip-vit-b32": "nnx_zoo.experiments.vision.clip_vit_b32",
    "speech/spoken-digits": "nnx_zoo.experiments.speech.spoken_digits",
    "diffusion/dit-digits": "nnx_zoo.experiments.diffusion.dit_digits",
}
DEFAULT = "lm/shakespeare-char"
