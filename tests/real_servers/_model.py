"""A tiny deterministic LLaMA model in GGUF, written with the ``gguf`` package (no download).

The model is random: what it writes is gibberish. What the suite needs from it is that
llama.cpp loads it as an ordinary LLaMA model with a working tokenizer and chat template,
so that everything touba depends on is the server's real behaviour (its chat templates,
request validation, grammar-constrained tool calls and JSON, SSE, usage).

- **Architecture**: ``llama``, 2 layers, hidden size 64, 4 heads of 16, feed-forward 128,
  F32 weights drawn from a fixed seed: the same bytes on every run (about 0.5 MB).
- **Tokenizer**: GPT-2 style byte-level BPE (``tokenizer.ggml.model = "gpt2"``): the 256
  byte tokens, a few dozen merges of common English pairs, and ``<|endoftext|>``,
  ``<|im_start|>``, ``<|im_end|>`` as control tokens (``<|im_end|>`` ends a turn). Any
  text tokenizes, any token sequence decodes.
- **Chat template**: ChatML with tools, as Qwen's models ship it (tool calls rendered as
  ``<tool_call>`` blocks, tool results as ``<tool_response>`` in a user turn, an
  assistant message's missing ``content`` tolerated). It is deliberately not
  llama-cpp-python's built-in ChatML string, which the server would recognise and run as
  ``--chat_format chatml``: the "model's own template" is a third format.
- **Ends**: random weights alone make every token about equally likely, so a reply would
  run to ``max_tokens`` and a JSON string would rarely close (greedy decoding never closes
  one). Hidden dimension 0 is therefore set in every embedding (its sign flipped for
  ``\\n`` and space) and read by the output rows of ``<|im_end|>``, ``"`` and ``]``:
  sampled at temperature 0.8, replies and strings end within a few dozen tokens, and never
  right after a newline or a space (so a reply is never blank). Dimension 1, set in every
  embedding too, is read negatively by the rows of the control bytes and of the bytes
  0x7f-0xff: the model writes printable ASCII only (the server's JSON grammar lets raw
  control characters into strings, which no JSON parser accepts, and a lone byte of a
  multi-byte character decodes to nothing).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

__all__ = ["CHAT_TEMPLATE", "END_OF_TURN", "SPECIAL", "vocabulary", "write_model"]

END_OF_TURN = "<|im_end|>"
SPECIAL = ("<|endoftext|>", "<|im_start|>", END_OF_TURN)

EMBEDDING = 64
LAYERS = 2
HEADS = 4
FEED_FORWARD = 128
CONTEXT = 4096
SEED = 20_301

# Pairs merged after the 256 bytes (GPT-2's byte alphabet: "Ġ" is a space): enough for
# "a few hundred" tokens and for the tokenizer's merge path to be exercised.
_MERGES = (
    *(f"Ġ {c}" for c in "abcdefghijklmnopqrstuvwxyz"),
    "t h",
    "h e",
    "i n",
    "e r",
    "a n",
    "r e",
    "o n",
    "a t",
    "e n",
    "n d",
    "o r",
    "e s",
    "Ġt he",
    "Ġa nd",
    '" :',
    '" ,',
    '{ "',
)

# Qwen2.5's ChatML template with tools, shortened (one system turn, tool calls as JSON in
# <tool_call> blocks, tool results in <tool_response> blocks of a user turn).
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object within "
    "<tool_call></tool_call> XML tags.<|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'system' and not loop.first %}"
    "{{- '<|im_start|>system\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for call in message.tool_calls %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' + call.function.name + \'", "arguments": \' }}'
    "{{- call.function.arguments if call.function.arguments is string "
    "else (call.function.arguments | tojson) }}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _byte_alphabet() -> list[str]:
    """GPT-2's printable stand-in for each byte, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = dict(zip(printable, printable, strict=True))
    extra = 0
    for byte in range(256):
        if byte not in chars:
            chars[byte] = 256 + extra
            extra += 1
    return [chr(chars[byte]) for byte in range(256)]


def vocabulary() -> tuple[list[str], list[str]]:
    """The tokens (bytes, merged pairs, then the special tokens) and the merges."""
    tokens = _byte_alphabet()
    known = set(tokens)
    for merge in _MERGES:
        left, right = merge.split(" ")
        if left not in known or right not in known:
            raise AssertionError(f"merge {merge!r} joins a token that does not exist yet")
        tokens.append(left + right)
        known.add(left + right)
    return [*tokens, *SPECIAL], list(_MERGES)


def write_model(path: Path) -> Path:
    """Write the model to ``path`` (the same bytes every time) and return it."""
    import gguf

    tokens, merges = vocabulary()
    n_vocab = len(tokens)
    index = {token: i for i, token in enumerate(tokens)}
    rng = np.random.default_rng(SEED)

    def normal(*shape: int, scale: float) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    head = EMBEDDING // HEADS
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("touba-tiny-random")
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(EMBEDDING)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FEED_FORWARD)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(HEADS)
    writer.add_rope_dimension_count(head)
    writer.add_rope_freq_base(10_000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(n_vocab)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)

    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    types = [gguf.TokenType.NORMAL] * (n_vocab - len(SPECIAL)) + [gguf.TokenType.CONTROL] * len(
        SPECIAL
    )
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(index["<|endoftext|>"])
    writer.add_eos_token_id(index[END_OF_TURN])
    writer.add_pad_token_id(index["<|endoftext|>"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)

    # Embeddings: small random values, and hidden dimension 0 set (+1; -1 for "\n" and " ")
    # so that after the final norm it dominates, and the output rows below read it.
    # Dimension 1 is set in every embedding too: the output rows of the bytes outside
    # printable ASCII read it negatively, so the model never writes one.
    embeddings = normal(n_vocab, EMBEDDING, scale=0.1)
    embeddings[:, 0] = 1.0
    for byte in (ord("\n"), ord(" ")):
        embeddings[index[_byte_alphabet()[byte]], 0] = -1.0
    embeddings[:, 1] = 1.0
    output = normal(n_vocab, EMBEDDING, scale=0.1)
    output[:, 0:2] = 0.0
    output[[*range(0x20), *range(0x7F, 0x100)], 1] = -4.0
    for token, weight in ((END_OF_TURN, 1.5), (_byte_alphabet()[ord('"')], 1.5), ("]", 1.0)):
        output[index[token], 0] = weight
    writer.add_tensor("token_embd.weight", embeddings)
    writer.add_tensor("output_norm.weight", np.ones(EMBEDDING, dtype=np.float32))
    writer.add_tensor("output.weight", output)
    for layer in range(LAYERS):
        block = f"blk.{layer}"
        writer.add_tensor(f"{block}.attn_norm.weight", np.ones(EMBEDDING, dtype=np.float32))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            writer.add_tensor(f"{block}.{name}.weight", normal(EMBEDDING, EMBEDDING, scale=0.05))
        writer.add_tensor(f"{block}.ffn_norm.weight", np.ones(EMBEDDING, dtype=np.float32))
        writer.add_tensor(f"{block}.ffn_gate.weight", normal(FEED_FORWARD, EMBEDDING, scale=0.05))
        writer.add_tensor(f"{block}.ffn_up.weight", normal(FEED_FORWARD, EMBEDDING, scale=0.05))
        writer.add_tensor(f"{block}.ffn_down.weight", normal(EMBEDDING, FEED_FORWARD, scale=0.05))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
