"""Prompts: datasets, synthetic and generated tasks, the resumable iterator, and the tokenizer."""
