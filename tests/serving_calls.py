"""What the serving tests run: seeded prompts, the generation and continuous-batching configs of the 2-bit pool,
`generate_batch` and `generate` with the options the pool runs, and requests submitted while others decode (pyproject's
`pythonpath` makes this module importable by name)."""

from __future__ import annotations

import torch
from transformers import ContinuousBatchingConfig, GenerationConfig

from oscar_hf.serving import pool_config


def random_prompts(lengths, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 97, (n,), generator=generator).tolist() for n in lengths]


def generation_config(options: dict | None, new_tokens: int, **extra) -> GenerationConfig:
    """Greedy `new_tokens` tokens through the 2-bit pool with `options` (its `cache_config`), or the stock bf16 pool
    where `options` is None."""
    oscar = {} if options is None else {"cache_implementation": "oscar", "cache_config": options}
    return GenerationConfig(**{"max_new_tokens": new_tokens, "do_sample": False, **oscar, **extra})


def cb_config(**options) -> ContinuousBatchingConfig:
    return ContinuousBatchingConfig(**{"num_blocks": 96, "max_batch_tokens": 2048, **options})


def generate_batch(model, prompts: list[list[int]], options: dict | None, new_tokens: int, **cb_options) -> list:
    """Greedy tokens of each prompt through continuous batching (`generation_config`, `cb_config`)."""
    outputs = model.generate_batch(
        prompts,
        generation_config=generation_config(options, new_tokens),
        continuous_batching_config=cb_config(**cb_options),
    )
    assert len(outputs) == len(prompts) and all(o.error is None for o in outputs.values()), outputs
    return [o.generated_tokens for o in outputs.values()]


def generate(model, prompt: list[int], options: dict, new_tokens: int, **kwargs) -> list[int]:
    """Greedy tokens through `generate(cache_implementation="oscar")` with the options the pool runs."""
    out = model.generate(
        torch.tensor([prompt], device=model.device),
        max_new_tokens=new_tokens,
        do_sample=False,
        cache_implementation="oscar",
        cache_config=pool_config(options),
        pad_token_id=0,
        **kwargs,
    )
    return out[0, len(prompt) :].tolist()


def submit_while_decoding(model, prompts, generation_config, continuous_batching_config, timeout: float) -> list:
    """Submit the first prompt, wait until it decoded a token, submit the rest: every request's generated tokens,
    in submission order."""
    manager = model.init_continuous_batching(
        generation_config=generation_config, continuous_batching_config=continuous_batching_config
    )
    manager.start()
    try:
        first = manager.add_request(prompts[0], streaming=True)
        while True:  # until the first request decodes
            output = manager.get_result(first, timeout=timeout)
            if output is not None and output.generated_tokens:
                break
        ids = [first] + [manager.add_request(p) for p in prompts[1:]]
        results = {}
        while len(results) < len(ids):
            output = manager.get_result(timeout=timeout)
            assert output is not None and output.error is None, output
            if output.is_finished():
                results[output.request_id] = output.generated_tokens
    finally:
        manager.stop(block=True)
    return [results[i] for i in ids]
