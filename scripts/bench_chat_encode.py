"""What encoding a multi-turn chat costs the API process, by pieces through the cache
(loader/segment_cache.py) against the whole text (CPU, the embedded SmolLM2 tokenizer).

--conversations conversations of --turns turns, as `pdserve bench serve --dataset-name
multi-turn` sends them: each turn is the whole history (system prompt, earlier user messages
and answers) plus a new user message, rendered with the model's chat template; the turns arrive
round-robin (every conversation's turn 1, then turn 2, ...). Each text is encoded both ways, in
alternating order, and the ids are compared. Reports the mean ms per text for each turn index
and over all, and the mean tokens per text.

    PYTHONPATH=. python scripts/bench_chat_encode.py [--output out.json]
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

from pdserve.bench.common import git_info, hardware_info, write_result
from pdserve.loader.default_model import default_gguf_path
from pdserve.loader.segment_cache import SegmentEncoder
from pdserve.loader.tokenizer import Tokenizer

WORDS = ("the a of to and in is it you that was for on are with as I his they be at one have "
         "this from or had by word but not what all were we when your can said there use an "
         "each which she do how their if will up other about out many then them these so").split()


def message(rng: random.Random, lo: int, hi: int) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(lo, hi))]
    for i in range(0, len(words), rng.randint(8, 20)):
        words[i] = words[i].capitalize() + rng.choice([",", ".", "\n", ""])
    return " ".join(words) + "."


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--conversations", type=int, default=64)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system-words", type=int, default=150)
    p.add_argument("--user-words", type=int, nargs=2, default=[15, 45])
    p.add_argument("--answer-words", type=int, nargs=2, default=[60, 200])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output")
    a = p.parse_args(argv)
    tok = Tokenizer.from_gguf_file(default_gguf_path())
    rng = random.Random(a.seed)
    convs = [[{"role": "system", "content": message(rng, a.system_words, a.system_words)}]
             for _ in range(a.conversations)]
    backend = tok.backend
    pieces = SegmentEncoder.for_backend(backend)
    if pieces is None:
        raise SystemExit("this tokenizer is not encoded by pieces")
    by_turn: dict[int, dict[str, list[float]]] = {}
    tokens: dict[int, list[int]] = {}
    k = 0
    for turn in range(a.turns):
        for conv in convs:
            conv.append({"role": "user", "content": message(rng, *a.user_words)})
            text = tok.apply_chat_template(conv, True)
            row = by_turn.setdefault(turn + 1, {"pieces": [], "whole": []})
            for side in (("pieces", "whole") if k % 2 else ("whole", "pieces")):
                t0 = time.perf_counter()
                ids = (pieces.encode(text) if side == "pieces"
                       else backend.encode_batch([text], add_special_tokens=False)[0].ids)
                row[side].append((time.perf_counter() - t0) * 1e3)
                if side == "whole":
                    ref = ids
                else:
                    got = ids
            if got != ref:
                raise SystemExit(f"turn {turn + 1}: the ids differ")
            tokens.setdefault(turn + 1, []).append(len(ref))
            conv.append({"role": "assistant", "content": message(rng, *a.answer_words)})
            k += 1
    rows = []
    for t, row in by_turn.items():
        rows.append({"turn": t, "mean_tokens": round(statistics.mean(tokens[t]), 1),
                     "pieces_ms": round(statistics.mean(row["pieces"]), 3),
                     "whole_ms": round(statistics.mean(row["whole"]), 3)})
        print(f"turn {t}: {rows[-1]['mean_tokens']:7.1f} tokens  whole {rows[-1]['whole_ms']:.3f} ms"
              f"  pieces {rows[-1]['pieces_ms']:.3f} ms")
    allp = [x for r in by_turn.values() for x in r["pieces"]]
    allw = [x for r in by_turn.values() for x in r["whole"]]
    total = {"pieces_ms": round(statistics.mean(allp), 3), "whole_ms": round(statistics.mean(allw), 3),
             "speedup": round(statistics.mean(allw) / statistics.mean(allp), 2),
             "pieces_hit": pieces.pieces_hit, "pieces_encoded": pieces.pieces_encoded,
             "cached_chars": pieces.cached_chars}
    print(f"all turns: whole {total['whole_ms']:.3f} ms, pieces {total['pieces_ms']:.3f} ms per text "
          f"({total['speedup']:.2f}x); pieces hit {pieces.pieces_hit}, encoded {pieces.pieces_encoded}")
    if a.output:
        write_result(a.output, {"command": " ".join(["python", *sys.argv]), **git_info(),
                                "hardware": hardware_info(), "config": vars(a),
                                "tokenizer": tok.source, "turns": rows, "all": total})
    return 0


if __name__ == "__main__":
    sys.exit(main())
