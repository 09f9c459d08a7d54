"""Tensor parallel on the CPU: two gloo processes, each holding half of a layer's KV heads.

Omni-Token Scaling divides a key token by its norm over *all* KV heads of the layer. Under tensor parallelism a rank
sees only its shard, so the cache all-reduces the squared norms (one collective per quantized block) and every rank
quantizes with the norm a single device would use: the same codes, scales and norms for its heads.
(The GPU run of a real model, `tp_plan="auto"` under torchrun, is benchmarks/bench_multigpu.py.)
"""

import os
import socket

import pytest
import torch
import torch.distributed as dist
from oscar_hf.kernels import DECODE_MAX_QUERY_ROWS
from transformers import LlamaConfig

from oscar_hf import OscarCache, OscarLayer
from oscar_hf.cache.backends import query_tokens
from oscar_hf.reference import token_norms

WORLD = 2
KV_HEADS, HEAD_DIM, TOKENS = 4, 32, 150  # 150 tokens: one block of 128 is quantized, 22 stay in the residual


def _config() -> LlamaConfig:  # GQA 8: 32 query heads over 4 KV heads
    return LlamaConfig(
        hidden_size=256, num_attention_heads=32, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, num_hidden_layers=1
    )


def _keys_values(dtype=torch.float64):
    """The same K/V on every rank: a seeded generator, with token norms spread over three orders of magnitude."""
    generator = torch.Generator().manual_seed(1234)
    shape = (1, KV_HEADS, TOKENS, HEAD_DIM)
    scale = 10 ** torch.empty(1, 1, TOKENS, 1).uniform_(-1, 2, generator=generator)
    keys = torch.randn(shape, generator=generator) * scale
    values = torch.randn(shape, generator=generator)
    return keys.to(dtype), values.to(dtype)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(fn, *args) -> None:
    """Run fn(rank, *args) in WORLD forked processes joined in a gloo group; a failure in any of them is raised."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    torch.multiprocessing.start_processes(_in_group, args=(fn, *args), nprocs=WORLD, start_method="fork")


def _in_group(rank, fn, *args):
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD))  # as torchrun sets them
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        fn(rank, *args)
    finally:
        dist.destroy_process_group()


def _shard(t: torch.Tensor, rank: int) -> torch.Tensor:
    per_rank = t.shape[1] // WORLD
    return t[:, rank * per_rank : (rank + 1) * per_rank]


def _check_token_norms(rank):
    keys, _ = _keys_values(torch.float32)
    local = _shard(keys, rank)
    torch.testing.assert_close(token_norms(local, dist.group.WORLD), token_norms(keys), rtol=1e-6, atol=0)
    assert not torch.allclose(token_norms(local), token_norms(keys), rtol=1e-2)  # a per-rank norm is another norm


def test_token_norms_all_reduced_over_head_shards_equal_one_process():
    _spawn(_check_token_norms)


def _check_sharded_cache(rank, want):
    keys, values = _keys_values()
    cache = OscarCache(_config())
    cache.update(_shard(keys, rank), _shard(values, rank), 0)
    layer = cache.layers[0]
    assert layer.head_group is dist.group.WORLD
    # compiled steps would quantize with per-rank norms: the cache must not let generate compile them
    assert any(reason.startswith("tensor parallel") for reason in cache.compile_blockers())
    # the fused kernel's limit on query rows per KV head uses the model's GQA group (8), which sharding keeps
    assert query_tokens(_config(), layer.kv_shape[0]) == DECODE_MAX_QUERY_ROWS // 8
    stored = layer.quantized()
    assert layer.quantized_length == 128
    torch.testing.assert_close(stored.key_norms, want.key_norms, rtol=1e-6, atol=0)
    for field in ("key_codes", "key_scale", "key_min", "value_codes", "value_scale", "value_min"):
        assert torch.equal(getattr(stored, field), _shard(getattr(want, field), rank)), field


def test_sharded_cache_stores_what_one_process_stores_for_its_heads():
    """Each rank's quantized region (codes, scales, mins, norms) equals the single-process cache's for its heads."""
    keys, values = _keys_values()
    cache = OscarCache(_config())
    cache.update(keys, values, 0)
    assert cache.layers[0].head_group is None  # one process holding every head: nothing to reduce
    _spawn(_check_sharded_cache, cache.layers[0].quantized())


def _check_mismatched_shard_is_refused(rank):
    keys, values = _keys_values()
    cache = OscarCache(_config())
    with pytest.raises(ValueError, match=r"holds 1 of the model's 4 KV heads, but the tensor-parallel group has 2"):
        cache.update(keys[:, :1], values[:, :1], 0)


def test_heads_that_do_not_shard_over_the_group_are_refused():
    _spawn(_check_mismatched_shard_is_refused)


def test_one_process_with_fewer_heads_than_the_config_reduces_nothing():
    """Without torch.distributed the layer holds every head it has (e.g. per-layer KV head counts): no reduction."""
    keys, values = _keys_values()
    cache = OscarCache(_config())
    cache.update(keys[:, :2], values[:, :2], 0)
    assert isinstance(cache.layers[0], OscarLayer) and cache.layers[0].head_group is None


# ---------------------------------------------------------------------------------------------------------------
# End to end: a tiny float64 Llama loaded with tp_plan="auto" in two gloo processes generates with the oscar cache
# exactly as one process does (float64, so the only difference TP could make is in what the cache stores).

# 2-bit widths: bits="auto" would price each rank's storage (a token norm per rank, over half the heads) above one
# process's, so the two may choose different widths at the budget's edge.
GENERATE = dict(
    max_new_tokens=20, min_new_tokens=20, do_sample=False, return_dict_in_generate=True, output_logits=True,
    cache_config={"bits": 2},
)  # fmt: skip


def _tp_generate(rank, path, prompt, want_logits):
    from transformers import AutoModelForCausalLM, DistributedConfig

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float64, distributed_config=DistributedConfig(tp_plan="auto")
    )
    out = model.generate(prompt, cache_implementation="oscar", **GENERATE)
    layer = out.past_key_values.layers[0]
    assert layer.head_group is not None and layer.residual_keys.shape[1] == KV_HEADS // WORLD
    assert layer.quantized_length == 128
    torch.testing.assert_close(torch.stack(out.logits), want_logits, rtol=0, atol=1e-9)


def test_tp_plan_generate_equals_one_process(tiny_llama, tmp_path):
    model = tiny_llama(torch.float64, num_attention_heads=8, num_key_value_heads=KV_HEADS, hidden_size=128)
    model.save_pretrained(tmp_path)
    prompt = torch.randint(3, 97, (1, TOKENS))
    out = model.generate(prompt, cache_implementation="oscar", **GENERATE)
    assert out.past_key_values.layers[0].head_group is None
    _spawn(_tp_generate, str(tmp_path), prompt, torch.stack(out.logits))
