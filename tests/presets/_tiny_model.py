"""Build a tiny random Llama that vLLM serves offline with ``--load-format dummy``.

The folder holds only what vLLM reads before it makes up the weights: a
``config.json`` for ``LlamaForCausalLM`` and a small word-level tokenizer
built with the ``tokenizers`` library (``tokenizer.json`` plus
``tokenizer_config.json``).  Every word ``w0 .. wN`` is one token and the
decoder joins tokens with single spaces, so decoding and re-encoding a
token sequence gives it back: what ``vllm bench serve``'s random dataset
needs to hit its prompt lengths.
"""

from __future__ import annotations

import json
from pathlib import Path

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")


def write_tiny_llama(
    folder: Path,
    *,
    vocab_size: int = 512,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 2,
    num_kv_heads: int = 2,
    max_position_embeddings: int = 1024,
) -> Path:
    """Write the model folder and return its path.

    ``vocab_size`` counts the three special tokens; the rest are the words
    ``w0``, ``w1``, ... .
    """
    if vocab_size <= len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must exceed {len(SPECIAL_TOKENS)}, got {vocab_size}")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    folder.mkdir(parents=True, exist_ok=True)
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for i in range(vocab_size - len(SPECIAL_TOKENS)):
        vocab[f"w{i}"] = len(vocab)
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer.save(str(folder / "tokenizer.json"))

    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": "<unk>",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "model_max_length": max_position_embeddings,
        "clean_up_tokenization_spaces": False,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))

    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": hidden_size // num_heads,
        "max_position_embeddings": max_position_embeddings,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder
