"""Compiled decode with an OScaR cache you own: eager prefill, then `torch.compile(model.forward,
mode="reduce-overhead", fullgraph=True)` for the single-token steps (CUDA graphs), as transformers' docs show for a
StaticCache. Needs a CUDA GPU and an sdpa model whose head_dim the fused kernel supports (64, 128 or 256).

    python examples/compiled_decode.py [--model MODEL_NAME_OR_PATH] [--new-tokens 64]

Without --model it builds a small random Llama (its tokens are meaningless; the point is the loop).
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from oscar_hf import OscarCache, OscarConfig, cache_kwargs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()

    if args.model:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16, attn_implementation="sdpa")
    else:
        config = LlamaConfig(hidden_size=1024, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=8,
                             num_key_value_heads=2, head_dim=128)  # fmt: skip
        model = LlamaForCausalLM._from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    model = model.cuda().eval()
    ids = torch.randint(0, model.config.vocab_size, (1, args.prompt_tokens), device="cuda")

    cache = OscarCache(model.config, OscarConfig())
    cache.reserve(ids.shape[1] + args.new_tokens)  # compiled steps need the maximum length up front
    if not cache.is_compileable:
        raise SystemExit(f"This model cannot decode compiled with OscarCache: {cache.compile_blockers()}")
    decode_step = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)

    with torch.inference_mode():
        out = model(ids, **cache_kwargs(cache), use_cache=True, logits_to_keep=1)  # prefill: eager
        cache.choose_bits()  # the layers' widths (bits="auto"), before the first compiled step: generate does this
        token = out.logits[:, -1:].argmax(-1)
        tokens, times = [token], []
        for _ in range(args.new_tokens - 1):
            start = time.perf_counter()
            out = decode_step(input_ids=token, **cache_kwargs(cache), use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
            tokens.append(token)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    steady = sorted(times[len(times) // 2 :])
    print(f"{args.new_tokens} tokens; median step {1000 * steady[len(steady) // 2]:.2f} ms (the first steps compile)")
    print(torch.cat(tokens, dim=1)[0].tolist())


if __name__ == "__main__":
    main()
