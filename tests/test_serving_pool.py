"""The 2-bit pool (`oscar_hf.serving.OscarPagedCache`) driven directly, as continuous batching drives it: every dense
K/V it returns equals what an `OscarCache` holding the same request returns for the same update, over random batch
schedules (requests of random prompt lengths, prompts in random chunks, decode steps, requests joining and leaving),
layouts and widths; and the memory it is made of (a page's bytes, the tails, the sectors)."""

import random

import pytest
import torch
from transformers import ContinuousBatchingConfig, LlamaConfig
from transformers.generation.continuous_batching.cache_allocators import FULL_ATTENTION
from transformers.generation.continuous_batching.distributed import DistributedHelper
from transformers.generation.continuous_batching.requests import RequestState

from oscar_hf import OscarCache, OscarConfig
from oscar_hf.serving import pool as pool_module
from oscar_hf.serving import pool_config
from oscar_hf.serving.pages import PageLayout, stack_views, strided_view
from oscar_hf.serving.pool import OscarPagedCache

HEADS, HEAD_DIM, LAYERS = 2, 32, 2


def _model_config() -> LlamaConfig:
    config = LlamaConfig(
        num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=HEADS, head_dim=HEAD_DIM, hidden_size=64
    )
    config._attn_implementation = "sdpa"
    return config


def _pool(oscar: OscarConfig, num_blocks: int = 64, sharing: bool = True) -> OscarPagedCache:
    cb_config = ContinuousBatchingConfig(
        num_blocks=num_blocks, max_batch_tokens=2048, allow_block_sharing=sharing, max_memory_percent=0.6
    )
    return OscarPagedCache(
        oscar,
        config=_model_config(),
        continuous_batching_config=cb_config,
        device=torch.device("cpu"),
        distributed_helper=DistributedHelper(None, None),
        dtype=torch.float32,
    )


class Driver:
    """Runs forwards through a pool the way transformers' batch processor does (allocate, record, update each layer),
    and through one `OscarCache` per request, comparing the dense K/V of every layer and request."""

    def __init__(self, pool: OscarPagedCache, oscar: OscarConfig):
        self.pool, self.oscar = pool, oscar
        self.states: dict[str, RequestState] = {}
        self.references: dict[str, OscarCache] = {}

    def forward(self, batch: dict[str, int]) -> None:
        """One forward: request id -> new tokens (a new id starts a request)."""
        steps = []
        for request_id, tokens in batch.items():
            if request_id not in self.states:
                self.states[request_id] = RequestState(request_id=request_id, initial_tokens=[0])
                self.references[request_id] = OscarCache(_model_config(), self.oscar)
            state = self.states[request_id]
            assert self.pool.can_store_request_tokens(state, tokens), "the test's pool is too small"
            steps.append((request_id, state.position_offset, tokens))
        writes = [[] for _ in self.pool.cache_allocators]
        for request_id, past, tokens in steps:
            self.pool.extend_read_and_write_indices(request_id, past, tokens, None, writes)
        lengths = torch.tensor([0] + [tokens for _, _, tokens in steps])
        kwargs = {
            "cu_seq_lens_q": torch.cumsum(lengths, 0),
            "cu_seq_lens_k": {FULL_ATTENTION: torch.cumsum(torch.tensor([0] + [p + t for _, p, t in steps]), 0)},
            "max_length_k": {FULL_ATTENTION: max(p + t for _, p, t in steps)},
        }
        total = int(lengths.sum())
        for layer in range(LAYERS):
            keys, values = torch.randn(2, 1, HEADS, total, HEAD_DIM).unbind(0)
            if random.random() < 0.3:  # outliers: a token with a large norm, as attention sinks have
                keys[:, :, random.randrange(total)] *= 30
            dense_keys, dense_values = self.pool.update(keys, values, layer, dict(kwargs))
            at, new_at = 0, 0
            for request_id, past, tokens in steps:
                expected = self.references[request_id].update(
                    keys[:, :, new_at : new_at + tokens], values[:, :, new_at : new_at + tokens], layer
                )
                got = dense_keys[:, :, at : at + past + tokens], dense_values[:, :, at : at + past + tokens]
                for name, want, have in zip(("keys", "values"), expected, got):
                    assert torch.equal(want, have), f"{name} of {request_id}, layer {layer}, past {past} + {tokens}"
                at, new_at = at + past + tokens, new_at + tokens
        for request_id, _, tokens in steps:
            self.states[request_id].position_offset += tokens

    def finish(self, request_id: str) -> None:
        self.pool.free_blocks(request_id)
        del self.states[request_id], self.references[request_id]


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"sink_tokens": 0},
        {"key_bits": 4, "value_bits": 2},
        {"key_bits": 3, "value_bits": 2},
        {"bits": 4, "residual_length": 64},
        {"sink_tokens": 7, "residual_length": 64, "token_scaling": False},
        {"rotation": False, "scale_dtype": "float32"},
    ],
)
def test_pool_returns_what_an_oscar_cache_returns(options, monkeypatch):
    """Random schedules: 1-3 requests join at once or while others decode, prompts of 1-700 tokens (below, at and past
    a page, several pages) fed whole or in chunks, 1-token decode steps; every update of every layer compared. Pages
    are read two at a time (the pool's bound on its dequantization transients, made small enough to matter here)."""
    monkeypatch.setattr(pool_module, "DEQUANTIZE_PAGES", 2)
    rng = random.Random(len(str(options)))
    random.seed(rng.random())
    oscar = pool_config(options)
    driver = Driver(_pool(oscar), oscar)
    window = oscar.residual_length
    prompts: dict[str, list[int]] = {}  # request -> its remaining prompt chunks
    decodes: dict[str, int] = {}
    for step in range(100):
        if len(prompts) + len(decodes) < 3 and rng.random() < 0.4:
            length = rng.choice([1, 3, window - 1, window, window + 1, window + oscar.sink_tokens, 2 * window + 5])
            length = rng.randint(1, 700) if rng.random() < 0.3 else length
            cuts = sorted(rng.sample(range(1, length), min(rng.randint(0, 2), length - 1)))
            prompts[f"r{step}"] = [b - a for a, b in zip([0, *cuts], [*cuts, length])]
        batch = {r: 1 for r in decodes}
        for request_id, chunks in list(prompts.items()):
            batch[request_id] = chunks.pop(0)
            if not chunks:
                del prompts[request_id]
                decodes[request_id] = rng.randint(1, 2 * window)
        if not batch:
            continue
        driver.forward(batch)
        for request_id in [r for r in decodes if r in batch and batch[r] == 1]:
            decodes[request_id] -= 1
            if not decodes[request_id]:
                del decodes[request_id]
                driver.finish(request_id)


def test_shared_prefix_pages_read_as_the_first_request_wrote_them():
    """Without sinks, a request whose prompt starts with another's complete pages shares them (transformers' prefix
    match); its dense history is the first request's K/V for those positions."""
    oscar = pool_config({"sink_tokens": 0})
    pool = _pool(oscar)
    driver = Driver(pool, oscar)
    prompt = list(range(300))
    driver.states["a"] = RequestState(request_id="a", initial_tokens=prompt)
    driver.references["a"] = OscarCache(_model_config(), oscar)
    driver.forward({"a": 300})
    driver.forward({"a": 1})
    pool.mark_complete_blocks(driver.states["a"], {FULL_ATTENTION: 2})
    assert pool.use_prefix_sharing
    matched = pool.search_prefix_match("b", prompt[:256] + [7] * 40)
    assert matched == 256
    state = RequestState(request_id="b", initial_tokens=prompt[:256] + [7] * 40)
    state.position_offset = matched
    assert pool.can_store_request_tokens(state, 40)
    pool.extend_read_and_write_indices("b", matched, 40, None, [[]])
    kwargs = {
        "cu_seq_lens_q": torch.tensor([0, 40]),
        "cu_seq_lens_k": {FULL_ATTENTION: torch.tensor([0, 296])},
        "max_length_k": {FULL_ATTENTION: 296},
    }
    keys, values = torch.randn(2, 1, HEADS, 40, HEAD_DIM).unbind(0)
    for layer in range(LAYERS):
        dense_keys, _ = pool.update(keys, values, layer, dict(kwargs))
        history = driver.references["a"].layers[layer].dense_history()[0][:, :, :256]
        assert torch.equal(dense_keys[:, :, :256], history)
        assert torch.equal(dense_keys[:, :, 256:], keys)
    assert pool.pages.block_table["b"][:2] == pool.pages.block_table["a"][:2]


def test_sinks_turn_prefix_sharing_off():
    """A request matching a prefix never computes its first tokens: with sinks (kept in the tail of the request that
    computed them), sharing could not be exact, so the pool does not share."""
    assert not _pool(pool_config({})).use_prefix_sharing
    assert _pool(pool_config({"sink_tokens": 0})).use_prefix_sharing
    assert not _pool(pool_config({"sink_tokens": 0}), sharing=False).use_prefix_sharing


def test_page_bytes_and_the_memory_they_save():
    """A page holds what an OscarLayer stores for its tokens: at Llama-3.1-8B's shape (8 KV heads, head_dim 128) and 2
    bits, 100 bytes per token and KV head, 128-token pages of 98,816 bytes per layer: 5.3x fewer than bf16's."""
    page = PageLayout.of(OscarConfig(bits=2), heads=8, head_dim=128)
    assert page.bytes == 128 * (8 * 96 + 4)
    assert 128 * 8 * 128 * 2 * 2 / page.bytes == pytest.approx(5.306, abs=1e-3)
    assert PageLayout.of(OscarConfig(key_bits=4, value_bits=2), heads=8, head_dim=128).bytes == 128 * (8 * 128 + 4)


def test_sectors_hold_pages_and_tails():
    """Tails and pages come from the same sectors: a tail is a whole number of page blocks, admitting a request takes
    one, finishing it gives it back, and the pool's free capacity counts both."""
    oscar = pool_config({})
    pool = _pool(oscar, num_blocks=32)
    assert pool.bytes_per_sector % pool.tails.bytes_per_block == 0
    assert pool.tails.bytes_per_block % pool.pages.bytes_per_block == 0
    assert pool.tails.bytes_per_block >= pool.tails.tail.bytes
    assert pool.compute_free_capacity() == 1
    state = RequestState(request_id="a", initial_tokens=[0] * 500)
    assert pool.can_store_request_tokens(state, 500)
    assert len(pool.pages.block_table["a"]) == (500 - 4 - 1) // 128 and len(pool.tails.block_table["a"]) == 1
    used = pool.num_sectors * pool.bytes_per_sector - pool.compute_free_capacity(relative=False)
    assert used >= 3 * pool.pages.bytes_per_block + pool.tails.bytes_per_block
    pool.free_blocks("a")
    pool.pool.try_to_free_sectors()
    assert pool.compute_free_capacity() == 1
    assert pool.max_request_tokens < pool.num_sectors * pool.bytes_per_sector // pool.pages.bytes_per_block * 128


def test_stack_views_reads_and_writes_every_layer():
    """One view over a field of consecutive layers: item (block, layer) is that layer's view's item of the block, and
    a write through it lands in every layer's view; views that do not step evenly are refused."""
    buffer = torch.randint(0, 255, (4096,), dtype=torch.uint8)
    views = [strided_view(buffer, torch.float16, 16 + 96 * layer, 512, (3, 5)) for layer in range(3)]
    stacked = stack_views(views)
    assert stacked.shape == (views[-1].shape[0], 3, 3, 5)
    for layer, view in enumerate(views):
        assert torch.equal(stacked[:, layer].view(torch.int16), view[: stacked.shape[0]].view(torch.int16))
    stacked[2] = torch.randn(3, 3, 5).half()
    assert all(torch.equal(stacked[2, layer], view[2]) for layer, view in enumerate(views))
    with pytest.raises(ValueError, match="evenly spaced"):
        stack_views([views[0], views[1], strided_view(buffer, torch.float16, 16 + 96 * 3, 512, (3, 5))])
