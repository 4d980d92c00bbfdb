"""Pre-tokenizer regexes of GGUF byte-level BPE vocabularies, per ``tokenizer.ggml.pre`` value.

The text is split by the pre-tokenizer regexes llama.cpp associates with ``tokenizer.ggml.pre``
(``src/llama-vocab.cpp``, ``llm_tokenizer_bpe``).  llama.cpp applies a *list* of regexes one after
the other: every regex cuts each piece produced so far into matches and the text between matches,
both kept.  That is exactly a sequence of ``tokenizers.pre_tokenizers.Split(regex,
behavior="isolated")`` steps, followed by the byte-level alphabet mapping (see gguf_vocab.py).

Also here: the ``pre`` values for which llama.cpp sets ignore_merges or turns add_bos on.
"""

from __future__ import annotations

import logging

__all__ = ["PRE_TOKENIZER_REGEXES", "pre_tokenizer_regexes", "IGNORE_MERGES_PRE", "ADD_BOS_PRE"]

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------
# Pre-tokenizer regexes, as llama.cpp's llm_tokenizer_bpe uses them per tokenizer.ggml.pre value.
# Each entry is a sequence of regexes applied one after another (see module docstring).
# ---------------------------------------------------------------------------------------------

# GPT-2's split (llama.cpp writes it without GPT-2's trailing "|\s+"; a lone whitespace character
# left unmatched becomes a piece of its own anyway, so the result is the same).
_RE_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
# Llama-3 (tokenizer.json has "(?i:'s|...)"; llama.cpp spells the case-insensitivity out).
_RE_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
              r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen2: the Llama-3 split with single digits.
_RE_QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
             r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Tekken (Mistral Nemo) and GPT-4o: the tokenizer.json originals (oniguruma has \p{Lu} etc., which
# llama.cpp's std::regex lacks, so llama.cpp rewrites them; the original is the reference).
_RE_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
              r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
              r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_RE_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
             r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
             r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
             r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
             r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")

_PRE_GPT2 = (_RE_GPT2,)
_PRE_DIGITS_GPT2 = (r"\p{N}", _RE_GPT2)  # every digit on its own, then GPT-2
_PRE_LLAMA3 = (_RE_LLAMA3,)
_PRE_QWEN2 = (_RE_QWEN2,)
# llama.cpp's LLAMA_VOCAB_PRE_TYPE_DEFAULT (used when tokenizer.ggml.pre is missing or "default").
_PRE_LLAMACPP_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _RE_GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")

#: tokenizer.ggml.pre value -> regex sequence.
PRE_TOKENIZER_REGEXES: dict[str, tuple[str, ...]] = {
    "default": _PRE_LLAMACPP_DEFAULT,
    # plain GPT-2 split
    "gpt2": _PRE_GPT2, "gpt-2": _PRE_GPT2, "phi-2": _PRE_GPT2, "mpt": _PRE_GPT2, "olmo": _PRE_GPT2,
    "jais": _PRE_GPT2, "jina-es": _PRE_GPT2, "jina-de": _PRE_GPT2, "jina-v2-es": _PRE_GPT2,
    "jina-v2-de": _PRE_GPT2, "gigachat": _PRE_GPT2, "exaone4": _PRE_GPT2, "trillion": _PRE_GPT2,
    "granite-docling": _PRE_GPT2,
    # single digits, then GPT-2 (SmolLM, StarCoder, ...)
    "smollm": _PRE_DIGITS_GPT2, "starcoder": _PRE_DIGITS_GPT2, "refact": _PRE_DIGITS_GPT2,
    "command-r": _PRE_DIGITS_GPT2, "codeshell": _PRE_DIGITS_GPT2, "exaone": _PRE_DIGITS_GPT2,
    "minerva-7b": _PRE_DIGITS_GPT2,
    # Llama-3 family
    "llama-bpe": _PRE_LLAMA3, "llama3": _PRE_LLAMA3, "llama-v3": _PRE_LLAMA3, "falcon3": _PRE_LLAMA3,
    "falcon-h1": _PRE_LLAMA3, "pixtral": _PRE_LLAMA3, "midm-2.0": _PRE_LLAMA3, "lfm2": _PRE_LLAMA3,
    "dbrx": _PRE_LLAMA3, "smaug-bpe": _PRE_LLAMA3, "chatglm-bpe": _PRE_LLAMA3, "glm4": _PRE_LLAMA3,
    # Qwen2 family
    "qwen2": _PRE_QWEN2, "deepseek-r1-qwen": _PRE_QWEN2, "stablelm2": _PRE_QWEN2,
    "megrez": _PRE_QWEN2,
    # others whose tokenizer.json regex oniguruma can run as-is
    "tekken": (_RE_TEKKEN,),
    "gpt-4o": (_RE_GPT4O,), "llama4": (_RE_GPT4O,),
}

# llama.cpp sets ignore_merges (a whole pre-token found in the vocab is used as is) for these.
IGNORE_MERGES_PRE = {"llama-bpe", "llama3", "llama-v3", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
                     "lfm2", "tekken"}
# llama.cpp turns add_bos on for these unless tokenizer.ggml.add_bos_token says otherwise.
ADD_BOS_PRE = {"llama-bpe", "llama3", "llama-v3", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
               "lfm2", "tekken"}


def pre_tokenizer_regexes(pre: str | None) -> tuple[str, ...]:
    """Regex sequence for a ``tokenizer.ggml.pre`` value.

    Missing -> llama.cpp's "default" sequence (llama.cpp warns and does the same).  Unknown name ->
    plain GPT-2 split with a warning (current llama.cpp refuses to load such a file instead).
    """
    if not pre:
        logger.warning("GGUF has no tokenizer.ggml.pre; using llama.cpp's 'default' pre-tokenizer "
                       "(tokenization may differ from the original model)")
        return _PRE_LLAMACPP_DEFAULT
    regexes = PRE_TOKENIZER_REGEXES.get(pre)
    if regexes is None:
        logger.warning("unknown pre-tokenizer %r in GGUF; falling back to the GPT-2 regex "
                       "(tokenization may differ from the original model)", pre)
        return _PRE_GPT2
    return regexes
