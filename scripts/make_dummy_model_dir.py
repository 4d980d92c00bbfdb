"""A Hugging Face model folder for a dummy-weight preset that can take text: the preset's
config.json with the embedded SmolLM2's tokenizer, and the vocabulary cut to that tokenizer's
49,152 ids so that every sampled id decodes (Qwen2.5-1.5B's 151,936-row embedding and LM head
shrink to 49,152 rows; every other shape is the preset's). For serving benchmarks that send text
(bench serve --dataset-name multi-turn) on a machine with no model hub. Run with --load-format
dummy:

    python scripts/make_dummy_model_dir.py qwen2.5-1.5b /tmp/qwen2.5-1.5b-text
    pdserve serve --model /tmp/qwen2.5-1.5b-text --load-format dummy ...
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from pdserve.loader.model_loader import load_tokenizer, resolve_source
from pdserve.models.presets import PRESETS


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in PRESETS:
        print(f"usage: make_dummy_model_dir.py PRESET OUT_DIR (presets: {', '.join(PRESETS)})",
              file=sys.stderr)
        return 2
    preset, out = argv
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = load_tokenizer(resolve_source(None))
    cfg = dict(PRESETS[preset], torch_dtype="bfloat16", vocab_size=tok.vocab_size,
               bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=1))
    backend = tok.backend
    if backend.decoder is None:   # (the GGUF-built backend leaves decoding to pdserve's Tokenizer)
        from tokenizers import decoders
        backend.decoder = decoders.ByteLevel()
    backend.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": tok.chat_template, "add_bos_token": tok.add_bos_token}, indent=1))
    print("wrote", out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
