"""A tiny byte-level BPE tokenizer trained here (no downloads), saved as a Hugging Face directory.

Shared by the text tests: every path a real `model.tokenizer: /models/...` takes runs on it.
"""

from __future__ import annotations

from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CORPUS = ["what is two plus two", "the answer is 4", "\\boxed{4}", "hello world", "a b c d e"]


def save_tiny_tokenizer(directory: Path, corpus: list[str] = CORPUS, vocab_size: int = 300) -> Path:
    """Train a byte-level BPE on `corpus` with `<pad>`, `<eos>` (the EOS token) and `<unk>`, give
    it a chat template and save it under `directory`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<eos>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(corpus, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    return directory
