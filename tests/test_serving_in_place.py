"""The 2-bit pool read in place (`oscar_hf.serving.history`), on the GPU where there is one; on a CPU the kernels run
in Triton's interpreter, with cache_config attention="fused" (tests/conftest.py sets TRITON_INTERPRET=1).

Driven as continuous batching drives it, the pool's in-place step for every request (decode steps through the block
table, prompt chunks over their gathered pages, first chunks by sdpa) matches the float64 attention over the same
history, which equals an `OscarCache`'s on the same backend bit for bit; through `generate_batch`, greedy tokens equal
the dense path's and `generate(attention="fused")`'s; the memory handler charges what in-place reads need."""

import pytest
import serving_calls
import torch
from devices import DEVICE
from serving_calls import cb_config, generate, generation_config, random_prompts, submit_while_decoding
from transformers import ContinuousBatchingConfig, LlamaConfig
from transformers.generation.continuous_batching.cache import PagedAttentionCache, PagedAttentionMemoryHandler
from transformers.generation.continuous_batching.cache_allocators import FULL_ATTENTION
from transformers.generation.continuous_batching.distributed import DistributedHelper
from transformers.generation.continuous_batching.requests import RequestState

from oscar_hf import OscarCache, OscarConfig
from oscar_hf.cache.backends import PortableBackend, TritonBackend
from oscar_hf.cache.step import STEP, step_of
from oscar_hf.integrations.fused_attention import fused_sdpa
from oscar_hf.layout import QuantizedKV
from oscar_hf.reference import decode_attention
from oscar_hf.serving import pool as pool_module
from oscar_hf.serving import pool_config
from oscar_hf.serving.history import PagedBatch, PagedHistory
from oscar_hf.serving.memory import READ_COLUMNS
from oscar_hf.serving.pages import gather_pages
from oscar_hf.serving.plan import RequestReads
from oscar_hf.serving.pool import OscarPagedCache
from oscar_hf.testing import assert_close_to_reference

FUSED = {"attention": "auto" if DEVICE.type == "cuda" else "fused", "residual_length": 64}  # a GPU needs no "fused"
HEADS, GQA, HEAD_DIM, LAYERS = 2, 2, 64, 1  # two layers: the generate_batch tests


def _model_config() -> LlamaConfig:
    config = LlamaConfig(
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS * GQA,
        num_key_value_heads=HEADS,
        head_dim=HEAD_DIM,
        hidden_size=64,
    )
    config._attn_implementation = "sdpa"
    return config


def _pool(oscar: OscarConfig) -> OscarPagedCache:
    cb_config = ContinuousBatchingConfig(num_blocks=256, max_batch_tokens=1024, max_memory_percent=0.6)
    return OscarPagedCache(
        oscar,
        config=_model_config(),
        continuous_batching_config=cb_config,
        device=DEVICE,
        distributed_helper=DistributedHelper(None, None),
        dtype=torch.float32,
    )


# Forwards of a schedule (request -> its tokens in the forward), pages of 64 tokens after 4 sinks: "a" prefills 131
# tokens (one page quantized, a window of 63), then decodes into a full window and past it (the flush); "b" holds
# fewer tokens than the sinks, then decodes into its first window token, and leaves; "c" is prefilled in two chunks,
# the second over a page, the sinks and a window; "d" has a second chunk over its sinks only. Forwards of decode
# steps only go through the block table (transformers' decode fast path, a padding row after the requests): "e" fills
# its window in the first and is flushed before the second.
SCHEDULE = [
    {"a": 131, "b": 3},
    {"a": 1, "b": 1, "c": 100},
    {"a": 1, "b": 1, "c": 70},
    {"a": 1, "c": 1, "d": 2},
    {"d": 30, "c": 1},
    {"d": 1, "e": 131},
    {"d": 1, "e": 1},
    {"e": 1, "d": 1},
]


def _assert_pool_holds_what_the_cache_holds(pool: OscarPagedCache, request_id: str, layer: int, cache: OscarCache):
    """The request's pages in `pool` are the quantized region of `cache`'s layer, and its tail's exact tokens (sinks,
    window) the layer's, bit for bit."""
    storage = cache.layers[layer].storage
    pages = storage.length // pool.pages.tokens_per_page
    blocks = torch.tensor(pool.pages.block_table.get(request_id, [])[:pages], dtype=torch.long, device=DEVICE)
    if pages:
        for name, want, have in zip(
            QuantizedKV._fields, storage.quantized(), gather_pages(pool.pages.views[layer], blocks)
        ):
            assert want is have is None or torch.equal(want, have), f"{name} of {request_id}, layer {layer}"
    tail = pool.tails.block_of(request_id)
    sinks = pool.oscar_config.sink_tokens
    for want, view in zip(storage.exact_tokens(), pool.tails.views[pool._layer_position[layer]]):
        have = torch.cat((view[tail, : storage.sinks_held], view[tail, sinks : sinks + storage.held]))
        assert torch.equal(want[0], have.transpose(0, 1)), f"exact tokens of {request_id}, layer {layer}"


@pytest.mark.parametrize(
    "options, free_late",
    [
        ({}, False),
        ({}, True),
        pytest.param({"sink_tokens": 0, "key_bits": 4}, False, marks=pytest.mark.slow),  # ~3 s each in the interpreter
    ],
    ids=["sinks", "sinks-freed-late", "nosinks-k4v2"],
)
def test_in_place_attention_matches_the_history(options, free_late):
    """Every forward and layer of the schedule: the pool holds, request by request, what an `OscarCache` on the same
    backend holds (pages and exact tokens, bit for bit); the step's attention over its pages in place, through the sdpa
    entry, equals float64 attention over its dense history (the fallback for attention features the kernels lack),
    under the mask that fallback builds. `free_late`: a finished request is freed after the next forward was prepared
    and ran, as asynchronous batching updates batch N after launching batch N + 1."""
    oscar = pool_config({**FUSED, **options})
    pool = _pool(oscar)
    assert pool.in_place and pool.max_tokens_read == READ_COLUMNS and isinstance(pool.backend, TritonBackend)
    states, caches = {}, {}
    scaling = HEAD_DIM**-0.5

    def free(finished):
        for request_id in finished:
            pool.free_blocks(request_id)
            del states[request_id], caches[request_id]

    for forward in SCHEDULE:
        finished = [r for r in states if r not in forward]
        if not free_late:
            free(finished)
        steps, table = [], None
        if all(tokens == 1 for tokens in forward.values()):  # rows of -1 after the requests: transformers' padding
            table = torch.full((1, len(forward) + 1, pool.max_blocks_per_request), -1, dtype=torch.int32, device=DEVICE)
        for i, (request_id, tokens) in enumerate(forward.items()):
            state = states.setdefault(request_id, RequestState(request_id=request_id, initial_tokens=[0]))
            caches.setdefault(request_id, OscarCache(_model_config(), oscar))
            assert pool.can_store_request_tokens(state, tokens)
            steps.append((request_id, state.position_offset, tokens))
            if table is None:
                pool.extend_read_and_write_indices(request_id, state.position_offset, tokens, None, [[]])
            else:
                pool.fill_block_table(request_id, state.position_offset, tokens, table[:, i])
        lengths = torch.tensor([0] + [tokens for *_, tokens in steps] + ([] if table is None else [1]))
        total = int(lengths.sum())
        for layer in range(LAYERS):
            kwargs = {
                "cu_seq_lens_q": torch.cumsum(lengths, 0),
                "cu_seq_lens_k": {FULL_ATTENTION: torch.cumsum(lengths, 0)},
                "max_length_k": {FULL_ATTENTION: int(lengths.max())},
                "block_table": table,
            }
            keys, values = torch.randn(2, 1, HEADS, total, HEAD_DIM, device=DEVICE).unbind(0)
            query = torch.randn(1, HEADS * GQA, total, HEAD_DIM, device=DEVICE)
            returned_keys, returned_values = pool.update(keys, values, layer, kwargs)
            step = step_of(returned_keys)
            assert returned_keys is keys and returned_values is values and kwargs[STEP] is step
            assert isinstance(step.history, PagedHistory)
            out = fused_sdpa(None, query, returned_keys, returned_values, None, scaling=scaling, **kwargs)
            out = out[0].transpose(1, 2)
            if table is None:  # the dense fallback's history and mask (a decode fast path has none: the cache's below)
                dense_keys, dense_values = step.dense_history()
                mask = step.dense_mask(None, query)
            at = new_at = 0
            for request_id, past, tokens in steps:
                rows, history = slice(new_at, new_at + tokens), slice(at, at + past + tokens)
                cached = step_of(caches[request_id].update(keys[:, :, rows], values[:, :, rows], layer)[0])
                if cached is not None:
                    cached.attended = True  # the cache's own attention is not under test
                _assert_pool_holds_what_the_cache_holds(pool, request_id, layer, caches[request_id])
                label = f"{request_id} at {past} + {tokens}, layer {layer}, {options}"
                own = (
                    (kv[:, :, history] for kv in (dense_keys, dense_values))
                    if table is None
                    else cached.dense_history()
                )
                reference = decode_attention(
                    query[:, :, rows].double(), None, *own, None, scaling, oscar, compute_dtype=torch.float64,
                    out_dtype=torch.float64,
                )  # fmt: skip
                assert_close_to_reference(out[:, :, rows], reference, torch.float32, label)
                if table is None:
                    allowed = torch.ones(tokens, past + tokens, dtype=torch.bool, device=DEVICE).tril(past)
                    assert torch.equal(mask[0, 0, rows, history] == 0, allowed), label
                at, new_at = at + past + tokens, new_at + tokens
            if table is None:
                assert (mask[0, 0] == 0).sum() == sum(t * p + t * (t + 1) // 2 for _, p, t in steps)  # nothing else
            else:
                assert out[:, :, new_at:].isfinite().all()  # the padding row attends to the trash tail
        for request_id, _, tokens in steps:
            states[request_id].position_offset += tokens
        if free_late:
            free(finished)


def test_memory_handler_charges_in_place_reads(monkeypatch):
    """At Llama-3.1-8B's shape (8 KV heads of 128, 32 layers, bf16) and 60 GiB for the cache, the in-place pool holds
    at least 4.5x the tokens of transformers' bf16 pool (sdpa, or flash attention: no mask, no repeated heads), where
    the dense path holds less than 3x sdpa's: each readable token is charged its pages and one layer's gathered
    copy and its column of the decode fast path's block table, not a dense read-back and a mask column. Built on the
    meta device (sizes only)."""
    monkeypatch.setattr(PagedAttentionMemoryHandler, "get_available_memory", lambda self: 60 * 2**30)
    config = LlamaConfig(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
    )

    def cb_config():
        return ContinuousBatchingConfig(max_batch_tokens=8192, max_requests_per_batch=1024, max_blocks_per_request=0)

    def tokens(cache) -> int:
        return max(a.tokens_per_page * a.num_blocks for a in cache.cache_allocators.values())

    helper = DistributedHelper(None, None)
    bf16 = {}
    for attention in ("sdpa", "flash_attention_2"):
        config._attn_implementation = attention
        bf16[attention] = tokens(PagedAttentionCache(config, cb_config(), "meta", helper, torch.bfloat16, True))
    config._attn_implementation = "sdpa"
    pools = {}
    for backend in (TritonBackend(4), PortableBackend()):  # as on a GPU (the meta device gets the portable one)
        monkeypatch.setattr(pool_module, "choose_backend", lambda *args, backend=backend: backend)
        pool = OscarPagedCache(pool_config({}), config, cb_config(), "meta", helper, torch.bfloat16, True)
        pools[pool.in_place] = tokens(pool)
        if pool.in_place:
            pool_sectors = pool.num_sectors
    assert pools[True] / bf16["sdpa"] > 6.4 and pools[True] / bf16["flash_attention_2"] > 5.2
    assert 2.7 < pools[False] / bf16["sdpa"] < 2.9
    # the decode fast path's block table (1024 rows of int32 spanning the longest request's pages, 77 MB) is paid for
    # in pages: charged nothing for it, the handler would have given the pool that many bytes more, to a sector
    from oscar_hf.serving.memory import InPlaceMemoryHandler

    monkeypatch.setattr(pool_module, "choose_backend", lambda *args: TritonBackend(4))
    monkeypatch.setattr(InPlaceMemoryHandler, "fixed_overhead_bytes", PagedAttentionMemoryHandler.fixed_overhead_bytes)
    monkeypatch.setattr(InPlaceMemoryHandler, "bytes_per_cache_token", property(lambda h: h.gathered_bytes_per_token))
    uncharged = OscarPagedCache(pool_config({}), config, cb_config(), "meta", helper, torch.bfloat16, True)
    table_bytes = 1024 * uncharged.max_blocks_per_request * torch.int32.itemsize
    unpaid = (uncharged.num_sectors - pool_sectors) * uncharged.bytes_per_sector
    assert abs(unpaid - table_bytes) < uncharged.bytes_per_sector, (unpaid, table_bytes)


# ------------------------------------------------------------------------------------------------------------------
# generate_batch


# the in-place path's pools: 48 blocks, batches of up to 1024 tokens
IN_PLACE = dict(num_blocks=48, max_batch_tokens=1024, use_cuda_graph=False)  # on a GPU: every forward eager


def generate_batch(model, prompts, options: dict, new_tokens: int, **cb_options) -> list:
    return serving_calls.generate_batch(model, prompts, options, new_tokens, **{**IN_PLACE, **cb_options})


@pytest.fixture(scope="module")
def llama(tiny_llama):
    """A tiny float32 Llama at a kernel head_dim (64), GQA 2:1, pages of 64 tokens in the tests' options."""
    torch.manual_seed(0)
    return tiny_llama(head_dim=64, eos_token_id=None).to(DEVICE)


@pytest.fixture
def in_place_calls(monkeypatch):
    """Counts the in-place steps attended, and fails if any fell back to the dense history."""
    calls = []
    original = PagedHistory.attention
    monkeypatch.setattr(PagedHistory, "attention", lambda self, *args: (calls.append(1), original(self, *args))[1])
    monkeypatch.setattr(PagedHistory, "dense", lambda self: pytest.fail("the dense fallback ran"))
    return calls


def test_tokens_equal_dense_path_and_generate(llama, in_place_calls, monkeypatch):
    """A prompt shorter than the sinks, one over a page whose window fills in its first decode step (quantized when
    the next begins): the decode steps on transformers' decode fast path (the block table, no host plan) attend to the
    pages in place, the flush before the forward."""
    table_forwards, flushes = [], []
    for owner, name, calls in ((PagedBatch, "from_table", table_forwards), (OscarPagedCache, "_flush", flushes)):
        original = getattr(owner, name)
        counted = lambda *args, _original=original, _calls=calls, **kwargs: (  # noqa: E731
            _calls.append(1),
            _original(*args, **kwargs),
        )[1]
        monkeypatch.setattr(owner, name, staticmethod(counted) if name == "from_table" else counted)
    prompts = random_prompts((3, 4 + 64 + 63))
    in_place = generate_batch(llama, prompts, FUSED, 3)
    assert len(in_place_calls) == 2 * 3  # every forward's two full-attention layers
    assert len(table_forwards) == 2 and len(flushes) == 1  # the two decode steps; the second request's window
    assert in_place == generate_batch(llama, prompts, {**FUSED, "attention": "portable"}, 3)
    assert in_place == [generate(llama, p, FUSED, 3) for p in prompts]


@pytest.mark.slow  # ~1 min in the interpreter
def test_split_prompts_and_requests_joining(llama, in_place_calls):
    """Prompts the scheduler splits (their later chunks over gathered pages), against chunked generate; requests
    joining while others decode; no sinks; forked sequences (sampling from the best token), against generate split
    before the last prompt token."""
    options = {**FUSED, "sink_tokens": 0}
    prompts = random_prompts((300,), seed=2)
    split = generate_batch(llama, prompts, options, 4, max_batch_tokens=128)
    assert split == [generate(llama, prompts[0], options, 4, prefill_chunk_size=128)]
    prompts = random_prompts((150, 5, 70), seed=3)
    tokens = submit_while_decoding(llama, prompts, generation_config(FUSED, 6), cb_config(**IN_PLACE), timeout=60)
    assert tokens == [generate(llama, p, FUSED, 6) for p in prompts]
    prompts = random_prompts((70, 200), seed=6)
    config = generation_config(FUSED, 4, do_sample=True, top_k=1, num_return_sequences=2)
    outputs = llama.generate_batch(prompts, generation_config=config, continuous_batching_config=cb_config(**IN_PLACE))
    forked = [[o.generated_tokens for o in outputs.values() if o.request_id.startswith(f"req_{i}")] for i in (0, 1)]
    assert forked == [[generate(llama, p, FUSED, 4, prefill_chunk_size=len(p) - 1)] * 2 for p in prompts]


def test_gemma3_hybrid_tokens_equal_generate(in_place_calls, tiny_gemma3):
    """Sliding-window layers through transformers' own path, full-attention ones read in place."""
    torch.manual_seed(0)
    model = tiny_gemma3(eos_token_id=None).to(DEVICE)
    prompts = random_prompts((3, 130))
    assert generate_batch(model, prompts, FUSED, 4) == [generate(model, p, FUSED, 4) for p in prompts]
    assert in_place_calls


def test_fused_attention_is_refused_where_the_kernels_cannot_run(tiny_llama):
    """attention="fused" demands the kernels, as a cache layer does: a head_dim they lack is refused by name (on a GPU
    as the manager starts, where it asks whether the decode steps can replay CUDA graphs; on a CPU as the pool is
    built)."""
    model = tiny_llama().to(DEVICE)  # head_dim 32
    with pytest.raises(ValueError, match="head dims 32/32 are not one of"):
        manager = model.init_continuous_batching(generation_config=generation_config({"attention": "fused"}, 2))
        manager.warmup()


@pytest.mark.slow  # ~25 s in the interpreter
def test_padded_batches_as_under_cuda_graphs(llama, monkeypatch):
    """Under CUDA graphs (a GPU's default for the pool: the decode-only forwards replayed) transformers pads every batch
    (prompt chunks to a multiple of 64 tokens with empty sequences, decode batches to a power of two with rows of -1 in
    the block table, which read and write the trash tail) and warms the paths up with made-up requests first; tokens
    still equal generate's; on a GPU with asynchronous batching too (the next batch prepared while this one computes,
    the flush on the forwards' stream). On a CPU (no graphs to capture, no streams) the padding and warmup as graphs
    would have them."""
    from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingAsyncIOs
    from transformers.generation.continuous_batching.model_runner import ModelRunner

    original = ModelRunner.__init__

    def padding(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.pad_inputs = True  # as under CUDA graphs

    if DEVICE.type != "cuda":
        monkeypatch.setattr(ModelRunner, "__init__", padding)
    rows, padded_rows, from_table, replays = [], [], PagedBatch.from_table, []

    def counted(table, **kwargs):
        rows.append(table.shape[0])
        if table.device.type == "cpu":  # reading the rows on a GPU would wait for it inside the graph's capture
            padded_rows.append(int((table[:, 0] < 0).sum()))
        return from_table(table, **kwargs)

    monkeypatch.setattr(PagedBatch, "from_table", staticmethod(counted))
    asynchronous, flush_streams = [], []
    if DEVICE.type == "cuda":
        replay = torch.cuda.CUDAGraph.replay
        monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", lambda graph: (replays.append(1), replay(graph))[1])
        async_init, write_layers = ContinuousBatchingAsyncIOs.__init__, pool_module.PageCodec.write_layers

        def counted_async(*args, **kwargs):
            asynchronous.append(1)
            async_init(*args, **kwargs)

        def flush_stream(codec, *args):
            flush_streams.append(torch.cuda.current_stream())
            write_layers(codec, *args)

        monkeypatch.setattr(ContinuousBatchingAsyncIOs, "__init__", counted_async)
        monkeypatch.setattr(pool_module.PageCodec, "write_layers", flush_stream)
    prompts = random_prompts((3, 140, 4 + 2 * 64 + 63), seed=5)  # the third request's window fills, flushed
    expected = [generate(llama, p, FUSED, 4) for p in prompts]
    options = {**IN_PLACE, "use_cuda_graph": None, "max_requests_per_batch": 8}
    assert serving_calls.generate_batch(llama, prompts, FUSED, 4, **options) == expected
    if DEVICE.type == "cuda":
        assert len(replays) >= 3 and 4 in rows  # three decode steps replayed; a graph of four rows captured
        assert not asynchronous and flush_streams and torch.cuda.default_stream() not in flush_streams
        replays.clear()
        flush_streams.clear()
        options["use_async_batching"] = True
        assert serving_calls.generate_batch(llama, prompts, FUSED, 4, **options) == expected
        assert asynchronous and len(replays) >= 3
        assert flush_streams and torch.cuda.default_stream() not in flush_streams
    else:
        assert rows[-3:] == [4, 4, 4] and padded_rows[-3:] == [1, 1, 1]  # three requests' steps padded to four rows


@pytest.mark.parametrize("requests", [1, 2, 3, 5])
def test_decode_tables_are_aligned_at_every_batch_size(requests: int):
    """A forward's decode table (`PagedBatch`): each request's page count, tail block, exact tokens and pages, and every
    section 16-byte aligned whatever the batch size, so that the paged kernel compiles one variant for all of them
    (kernels/decode_paged.py)."""
    reads = [
        RequestReads(query_at=i, new=1, past=130 * i, pages=list(range(10 * i, 10 * i + i)), tail=7 + i, sinks=0,
                     exact=3 + i, exact_at=None)
        for i in range(requests)
    ]  # fmt: skip
    batch = PagedBatch(reads, torch.device("cpu"))
    tensors = (batch.page_counts, batch.tail_blocks, batch.exact_tokens, batch.block_table)
    assert all(t.data_ptr() % 16 == 0 and t.dtype == torch.int32 for t in tensors)
    assert batch.page_counts.tolist() == list(range(requests))
    assert batch.tail_blocks.tolist() == [7 + i for i in range(requests)]
    assert batch.exact_tokens.tolist() == [3 + i for i in range(requests)]
    assert [row[:i] for i, row in enumerate(batch.block_table.tolist())] == [r.pages for r in reads]
    assert batch.decode_rows == slice(0, requests)
