"""Data: grain pipelines, tokenizers and the Shakespeare corpus."""
