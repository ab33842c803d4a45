"""Tiny text models made here, with no downloads: a byte-level BPE tokenizer and a hand-weighted
reward model, saved as Hugging Face directories.

The text, reward-model and remote-reward tests and the e2e reward fault case share them, so every
path a real `model.tokenizer: /models/...` or `model.reward: /models/...` takes runs.

The reward model: `save_tiny_reward_model` builds a one-layer
``Qwen2ForSequenceClassification`` whose score is a
known, increasing function of the fraction of *target tokens* in the sequence:

* Every token embeds to ``EMBED_SCALE * A * u``, a target token to
  ``EMBED_SCALE * (A * u + d)``, with ``u`` and ``d`` two orthogonal unit directions of the
  hidden space (``d`` is the score head's direction). The pad token embeds like the others.
* The attention query and key projections are zero, so attention is uniform over the causal
  prefix (and RoPE, which acts on queries and keys only, changes nothing); V and O are the
  identity, so the attention output at the last token is the mean over the sequence of the
  normalised embeddings. The MLP's down projection is zero.
* The embeddings are tiny (``EMBED_SCALE``) next to that mean, so the residual stream of the
  last token is that mean, and the score is ``sin`` of its angle to ``u``, scaled so that a
  sequence of target tokens only scores 1 and one without any scores 0: it rises with the
  fraction of target tokens, whatever their positions.

A target token is every vocabulary entry that decodes, stripped of white space, to the target
text (with a byte-level BPE both ``"4"`` and ``" 4"``).
"""

from __future__ import annotations

import math
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


HIDDEN = 16
A = 2.0
"""The shared component of every embedding, relative to the target's extra component."""
EMBED_SCALE = 1e-2


def target_token_ids(tokenizer: object, target_token: str) -> list[int]:
    """Ids of the vocabulary entries that decode (stripped) to `target_token`."""
    decode = tokenizer.decode  # type: ignore[attr-defined]
    size = len(tokenizer)  # type: ignore[arg-type]
    ids = [i for i in range(size) if decode([i]).strip() == target_token]
    if not ids:
        raise ValueError(f"no token of the tokenizer decodes to {target_token!r}")
    return ids


def save_tiny_reward_model(directory: Path, tokenizer_dir: Path, target_token: str) -> Path:
    """Save the tiny reward model preferring `target_token` and the tokenizer of
    `tokenizer_dir` (e.g. one `trainer.tiny_text.save_tiny_tokenizer` saved) under `directory`."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = Qwen2Config(  # type: ignore[call-arg]  # head_dim, num_labels: kwargs it accepts
        vocab_size=len(tokenizer),
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=HIDDEN // 2,
        max_position_embeddings=512,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = Qwen2ForSequenceClassification(config).float()
    u = torch.zeros(HIDDEN)
    u[0] = 1.0
    d = torch.zeros(HIDDEN)
    d[1] = 1.0
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()
        embedding = model.model.embed_tokens.weight
        embedding[:] = EMBED_SCALE * A * u
        for token_id in target_token_ids(tokenizer, target_token):
            embedding[token_id] = EMBED_SCALE * (A * u + d)
        layer = model.model.layers[0]
        layer.self_attn.v_proj.weight.copy_(torch.eye(HIDDEN))
        layer.self_attn.o_proj.weight.copy_(torch.eye(HIDDEN))
        layer.input_layernorm.weight.fill_(1.0)
        layer.post_attention_layernorm.weight.fill_(1.0)
        model.model.norm.weight.fill_(1.0)
        # The normalised stream has norm sqrt(HIDDEN); a target token alone sits at the angle
        # whose sine is 1 / sqrt(A^2 + 1) from u: scale that to 1.
        model.score.weight[0] = d * math.sqrt(A * A + 1) / math.sqrt(HIDDEN)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
