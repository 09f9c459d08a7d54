"""Compiled decode (issue 8): `torch.compile(fullgraph=True)` traces an OScaR decode step (custom ops, device-side
write position and block flush, the fused dispatch) in one graph, and gives the eager tokens. On CPU the kernels run
in Triton's interpreter and the graphs run with the aot_eager backend; the GPU tests use generate's own automatic
compile (Inductor, CUDA graphs)."""

import pytest
import torch
import torch._dynamo
from devices import DEVICE, slow_on_cpu
from transformers import Gemma3ForCausalLM, Gemma3nForCausalLM, Gemma3TextConfig, LlamaConfig, Qwen3NextForCausalLM
from transformers.generation import CompileConfig

from oscar_hf import OscarCache, OscarConfig, average_bits, cache_kwargs


def _sdpa_llama_config(**overrides):
    options = dict(num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=64, hidden_size=256)
    config = LlamaConfig(**{**options, **overrides})
    config._attn_implementation = "sdpa"
    return config


def test_is_compileable_only_where_the_fused_path_applies(gemma3_config):
    def compileable(config, reserve=True, **options):
        cache = OscarCache(config, OscarConfig(**options))
        if reserve:
            cache.reserve(1000)
        return cache.is_compileable

    assert compileable(_sdpa_llama_config())
    assert compileable(_sdpa_llama_config(), method="oscar")  # its key rotation is fixed at the end of the prefill
    assert not compileable(_sdpa_llama_config(), reserve=False)  # no maximum length: storage cannot be static
    assert not compileable(_sdpa_llama_config(), attention="portable")
    assert not compileable(_sdpa_llama_config(head_dim=32))
    eager = _sdpa_llama_config()
    eager._attn_implementation = "eager"
    assert not compileable(eager)
    gemma3_config._attn_implementation = "sdpa"
    assert compileable(gemma3_config)  # reserving makes the sliding-window layers static (tests/test_hybrid.py)
    assert not compileable(gemma3_config, reserve=False)  # they stay transformers' dynamic layers


def _decode(model, forward, prompt, steps, **options):
    """Eager prefill, then `steps` greedy single-token steps through `forward`; returns tokens and logits."""
    cache = OscarCache(model.config, OscarConfig(**options))
    cache.reserve(prompt.shape[1] + steps)
    with torch.no_grad():
        out = model(prompt, **cache_kwargs(cache), use_cache=True)
        token, tokens, logits = out.logits[:, -1:].argmax(-1), [], []
        for _ in range(steps):
            tokens.append(token)
            out = forward(input_ids=token, **cache_kwargs(cache), use_cache=True)
            logits.append(out.logits[:, -1].float())
            token = out.logits[:, -1:].argmax(-1)
    return torch.cat(tokens, 1), logits, cache


@pytest.mark.parametrize(
    "method, key_bits", [("oscar", 2), ("paper", 2), ("oscar", 4)], ids=["oscar", "paper", "oscar-K4V2"]
)
def test_compiled_decode_matches_eager_across_a_flush(tiny_llama, method, key_bits):
    """28 prompt tokens, blocks of 32: the 5th of 6 steps flushes a block, from the device counter alone; with
    method="oscar", with the key rotation chosen at the end of the (eager) prefill, before any block was full; 4-bit
    keys with 2-bit values, whose config reaches the ops as their key string."""
    model = tiny_llama(
        torch.bfloat16, vocab_size=101, hidden_size=256, intermediate_size=256, head_dim=64, num_hidden_layers=1
    )
    model.config._attn_implementation = "sdpa"
    prompt = torch.randint(3, 101, (1, 28), device=DEVICE)
    options = dict(attention="auto" if DEVICE.type == "cuda" else "fused", residual_length=32, method=method)
    options.update(key_bits=key_bits, sink_tokens=0)
    eager_tokens, eager_logits, eager_cache = _decode(model.to(DEVICE), model.forward, prompt, 6, **options)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    graph_outputs = []
    aot_eager = torch._dynamo.lookup_backend("aot_eager")

    def counting_outputs(gm, example_inputs):
        graph_outputs.append(len(next(node for node in gm.graph.nodes if node.op == "output").args[0]))
        return aot_eager(gm, example_inputs)

    compiled = torch.compile(model.forward, fullgraph=True, backend=counting_outputs)
    tokens, logits, cache = _decode(model, compiled, prompt, 6, **options)
    assert torch.equal(tokens, eager_tokens)
    for a, b in zip(logits, eager_logits):
        # Same codes and kernel; the compiled step reads the reserved storage whole, masked: fp32-level differences.
        torch.testing.assert_close(a, b, atol=1e-2, rtol=1e-2)
    layer = cache.layers[0]
    assert layer.get_seq_length() == 34 and layer.quantized_length == 32  # host lengths read back from the device
    if method == "oscar":
        assert torch.equal(layer.key_rotated, eager_cache.layers[0].key_rotated)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1  # one graph for every step, flush included
    assert not torch._dynamo.utils.counters["graph_break"]
    # The logits are the step's only output: the fused step's K/V do not outlive it (each output of a CUDA-graph replay
    # is rebuilt on the host while the GPU waits).
    assert graph_outputs == [1] and layer.fused_step is None


def test_a_compiled_step_the_cache_cannot_run_is_an_error(tiny_llama):
    model = tiny_llama(
        torch.bfloat16, vocab_size=101, hidden_size=256, intermediate_size=256, head_dim=64, num_hidden_layers=1
    )
    model.config._attn_implementation = "sdpa"
    prompt = torch.randint(3, 101, (1, 20), device=DEVICE)
    torch._dynamo.reset()
    compiled = torch.compile(model.to(DEVICE).forward, fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match="compiled forward can only run single-token decode steps on the fused path"):
        _decode(model, compiled, prompt, 1, attention="portable")


def test_generate_auto_compiles_an_oscar_cache(tiny_llama):
    """generate's own route (`_valid_auto_compile_criteria`, `compile_config`) on a left-padded batch across a
    flush: one graph for every decode step, the eager tokens. On CPU only through `_compile_all_devices`."""
    model = tiny_llama(
        torch.bfloat16, vocab_size=101, hidden_size=256, intermediate_size=256, head_dim=64, num_hidden_layers=1
    )
    model.config._attn_implementation = "sdpa"
    prompt = torch.randint(3, 101, (2, 28), device=DEVICE)
    mask = torch.ones_like(prompt)
    prompt[1, :5], mask[1, :5] = 0, 0
    options = dict(
        attention_mask=mask,
        cache_implementation="oscar",
        cache_config={"attention": "auto" if DEVICE.type == "cuda" else "fused", "residual_length": 32},
        do_sample=False,
        max_new_tokens=8,
        min_new_tokens=8,
    )
    _assert_auto_compile_matches_eager(model.to(DEVICE), prompt, options)


def _assert_auto_compile_matches_eager(model, prompt, options: dict):
    """generate's automatic compile (aot_eager; on CPU through `_compile_all_devices`) runs every decode step in one
    graph without a graph break and gives the eager tokens. Returns eager generate's output (its cache included)."""
    eager = model.generate(prompt, disable_compile=True, return_dict_in_generate=True, **options)
    compile_config = CompileConfig(fullgraph=True, backend="aot_eager", mode=None)
    compile_config._compile_all_devices = True
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = model.generate(prompt, compile_config=compile_config, return_dict_in_generate=True, **options)
    assert torch.equal(compiled.sequences, eager.sequences)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert not torch._dynamo.utils.counters["graph_break"]
    return eager


def _tiny_gemma3(window: int, **overrides) -> Gemma3ForCausalLM:
    """A random Gemma-3-style hybrid (sliding-window and full-attention layers, head_dim 256 as Gemma 3's), sdpa."""
    options = dict(
        vocab_size=101, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=256, sliding_window=window, max_position_embeddings=2048,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    )  # fmt: skip
    config = Gemma3TextConfig(**{**options, **overrides})
    config._attn_implementation = "sdpa"
    return Gemma3ForCausalLM(config).eval()


HYBRIDS = {"gemma3": Gemma3ForCausalLM, "gemma3n": Gemma3nForCausalLM, "qwen3next": Qwen3NextForCausalLM}


# Gemma 3 in the default run on a CPU; Gemma 3n's KV sharing and Qwen3-Next's linear attention there in `-m slow`
@pytest.mark.parametrize("family", ["gemma3", slow_on_cpu("gemma3n"), slow_on_cpu("qwen3next")])
def test_generate_auto_compiles_a_hybrid_model(request, family):
    """Gemma 3 (issue 36): the sliding-window layers are static, the full-attention ones OScaR layers, and generate's
    automatic compile takes the whole decode step: a prompt shorter than the window (16), which fills during decode,
    and 32 steps across a flush (blocks of 32), in one graph, with the eager tokens. Gemma 3n's last layers reuse
    the K/V of the last sliding and full layers (the fused step's keys stand for the producer's storage; transformers
    >= 5.24). Qwen3-Next's linear-attention layers keep transformers' own static state. On CPU through
    `_compile_all_devices` (aot_eager, the kernels in Triton's interpreter)."""
    config = request.getfixturevalue(f"{family}_config")
    config._attn_implementation = "sdpa"
    if family == "gemma3n" and getattr(config, "kv_sharing_modes", None) is None:
        pytest.skip("KV-sharing layers decode compiled from transformers 5.24 (tests/test_hybrid.py: the blocker)")
    model = HYBRIDS[family](config).to(DEVICE).eval()
    prompt = torch.randint(3, 97, (1, 5), device=DEVICE)
    options = dict(
        cache_implementation="oscar",
        cache_config={"attention": "auto" if DEVICE.type == "cuda" else "fused", "residual_length": 32},
        do_sample=False,
        max_new_tokens=32,
        min_new_tokens=32,
    )
    _assert_auto_compile_matches_eager(model, prompt, options)


@pytest.mark.parametrize(
    "prompt_length",  # on a CPU, a hybrid's compiled tokens: `test_generate_auto_compiles_a_hybrid_model`
    [slow_on_cpu(10), slow_on_cpu(40)],
    ids=["window-fills-in-decode", "window-full-from-prefill"],
)
def test_compiled_hybrid_logits_match_eager_in_float32(teacher_forcing, prompt_length):
    """Gemma 3's layout in float32 (a sliding-window layer, then a full-attention one), generate's automatic compile
    (aot_eager on CPU, the kernels in Triton's interpreter) against eager OScaR on the same tokens (teacher forcing),
    B=2 with row 1 left-padded by 3: the
    sliding window (16) fills or rolls from the first step and wraps twice, and a block (32) is flushed inside a
    compiled step. Both paths run the same float32 math in a different order (float32 rounding, ~1e-6 per op): each
    step's logits agree to 1e-4 relative until the first flush in decode. A flush's 2-bit rounding may then flip the
    code of an input that sits on a rounding boundary, a whole quantization step (one flipped code moves these logits
    by ~4e-4), so from there each step stays below 1e-2 and the median below 1e-4. A ring-buffer slot, window or mask
    off by one attends to a different token at every step after the window fills (a few 1e-2), and fails both."""
    model = _tiny_gemma3(16, head_dim=64, num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"])
    model = model.to(DEVICE)
    new_tokens, residual = 40, 32
    prompt = torch.randint(3, 101, (2, prompt_length), device=DEVICE)
    mask = torch.ones_like(prompt)
    prompt[1, :3], mask[1, :3] = 0, 0
    options = dict(
        attention_mask=mask,
        cache_implementation="oscar",
        cache_config={"attention": "auto" if DEVICE.type == "cuda" else "fused", "residual_length": residual},
        do_sample=False,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        output_logits=True,
        return_dict_in_generate=True,
    )
    compile_config = CompileConfig(fullgraph=True, backend="aot_eager", mode=None)
    compile_config._compile_all_devices = True
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = model.generate(prompt, compile_config=compile_config, **options)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    tokens = compiled.sequences[:, prompt_length:]
    replay = teacher_forcing(tokens, prompt_length)
    eager = model.generate(prompt, disable_compile=True, logits_processor=replay, **options)
    _assert_float32_logits_match(compiled, eager, prompt_length, residual)


def _assert_float32_logits_match(compiled, eager, prompt_length: int, residual: int) -> None:
    """float32 compiled vs eager logits, step by step (why these tolerances: the docstring of
    `test_compiled_hybrid_logits_match_eager_in_float32`): within 1e-4 relative until the first flush in decode, then
    below 1e-2 with the median below 1e-4 (a flush may flip a code that sits on a rounding boundary)."""
    differences = torch.stack([(a - b).norm() / b.norm() for a, b in zip(compiled.logits, eager.logits)])
    # step s (s >= 1) decodes position prompt_length + s - 1, flushing first when that many tokens fill whole blocks
    first_flush = next((s for s in range(1, len(differences)) if (prompt_length + s - 1) % residual == 0), None)
    assert differences[:first_flush].max() < 1e-4, differences
    assert differences.max() < 1e-2 and differences.median() < 1e-4, differences


def _generate(model, prompt, mask, new_tokens, compiled, logits_processor=None, cache_config=None):
    options = dict(disable_compile=True)
    if compiled:
        options = dict(compile_config=CompileConfig(fullgraph=True))  # generate's default: Inductor, CUDA graphs
    return model.generate(
        prompt,
        attention_mask=mask,
        cache_implementation="oscar",
        cache_config=cache_config,
        do_sample=False,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        output_logits=True,
        return_dict_in_generate=True,
        logits_processor=logits_processor,
        **options,
    )


def _assert_logits_match(compiled, eager, tokens):
    """Every step's compiled logits within bf16 rounding of eager's on the same tokens (teacher forcing), and each
    compiled token the eager argmax wherever the eager top-2 margin exceeds the difference between the two paths."""
    for step, (a, b) in enumerate(zip(compiled.logits, eager.logits)):
        a, b = a.float(), b.float()
        assert ((a - b).norm() / b.norm()).item() < 2e-2, step  # bf16 outputs of differently split attention
        top2 = b.topk(2, dim=-1).values
        decisive = (top2[:, 0] - top2[:, 1]) > 4 * (a - b).abs().amax()
        assert torch.equal(tokens[decisive, step], b.argmax(-1)[decisive]), step


def _gqa_llama_and_prompt(tiny_llama, batch: int, padding: int):
    """A random bf16 GQA Llama (4 layers, head_dim 128, sdpa) and a 300-token prompt batch whose rows after the first
    are left-padded by `padding` tokens."""
    model = tiny_llama(
        torch.bfloat16, vocab_size=1000, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, head_dim=128, max_position_embeddings=2048,
    ).to(DEVICE)  # fmt: skip
    model.config._attn_implementation = "sdpa"
    prompt = torch.randint(3, 1000, (batch, 300), device=DEVICE)
    mask = torch.ones_like(prompt)
    if batch > 1:
        prompt[1:, :padding], mask[1:, :padding] = 0, 0
    return model, prompt, mask


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 3])
def test_compiled_generate_matches_eager_generate(tiny_llama, teacher_forcing, batch):
    """generate's automatic compile (fullgraph, CUDA graphs) on a random GQA Llama, 1000 steps across seven block
    flushes (B=3 left-padded): every step's logits match eager OScaR on the same tokens (teacher forcing), each
    compiled token is the eager argmax wherever the eager top-2 margin exceeds the difference, and the whole
    generation compiles a bounded number of graphs."""
    model, prompt, mask = _gqa_llama_and_prompt(tiny_llama, batch, padding=57)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = _generate(model, prompt, mask, 1000, compiled=True)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert graphs == 1, graphs  # one graph for all 999 decode steps (measured on CPU: 1)
    tokens = compiled.sequences[:, prompt.shape[1] :]
    eager = _generate(model, prompt, mask, 1000, False, teacher_forcing(tokens, prompt.shape[1]))
    assert torch.equal(eager.sequences, compiled.sequences)
    _assert_logits_match(compiled, eager, tokens)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "prompt_length, batch, bits",
    [(40, 1, {}), (300, 1, {}), (40, 3, {}), (300, 3, {}), (40, 3, {"key_bits": 4, "value_bits": 2})],
    ids=["40-1", "300-1", "40-3", "300-3", "40-3-K4V2"],
)
def test_compiled_generate_with_the_query_rule_matches_eager_generate(
    tiny_llama, teacher_forcing, prompt_length, batch, bits
):
    """method="oscar" under generate's automatic compile (Inductor, CUDA graphs): each (row, KV head)'s key rotation
    is fixed when the eager prefill's queries arrive, so a 40-token prompt's first block is flushed inside a graphed
    step with the prefill's choice (a 300-token prompt quantizes its first block in the prefill, with the same rule).
    Compiled greedy decoding matches eager: both runs choose the same flags, every step's logits match eager on the
    same tokens (teacher forcing), and each compiled token is the eager argmax wherever the eager top-2 margin exceeds
    the difference between the paths (B=3: rows 1 and 2 left-padded by 17 tokens)."""
    model = tiny_llama(
        torch.bfloat16, vocab_size=1000, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, head_dim=128, max_position_embeddings=2048,
    ).to(DEVICE)  # fmt: skip
    model.config._attn_implementation = "sdpa"
    prompt = torch.randint(3, 1000, (batch, prompt_length), device=DEVICE)
    mask = torch.ones_like(prompt)
    if batch > 1:
        prompt[1:, :17], mask[1:, :17] = 0, 0
    options = {"method": "oscar", **bits}
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = _generate(model, prompt, mask, 300, compiled=True, cache_config=options)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    tokens = compiled.sequences[:, prompt_length:]
    replay = teacher_forcing(tokens, prompt_length)
    eager = _generate(model, prompt, mask, 300, False, replay, cache_config=options)
    for a, b in zip(compiled.past_key_values.layers, eager.past_key_values.layers):
        assert torch.equal(a.key_rotated, b.key_rotated)
        assert a.get_seq_length() == b.get_seq_length() == prompt_length + 299  # reads the compiled lengths back
        assert a.quantized_length == b.quantized_length == (prompt_length + 298) // 128 * 128
    _assert_logits_match(compiled, eager, tokens)


@pytest.mark.gpu
@pytest.mark.parametrize("prompt_length", [40, 300], ids=["window-fills-in-decode", "window-full-from-prefill"])
@pytest.mark.parametrize("batch", [1, 3])
def test_compiled_hybrid_generate_matches_eager_generate(teacher_forcing, prompt_length, batch):
    """Gemma 3's layout (issue 36) under generate's automatic compile (Inductor, CUDA graphs): static sliding-window
    layers (window 64) and OScaR full-attention layers, 600 steps across four block flushes and the window filling
    (a 40-token prompt) or rolling from the first step (300 tokens), B=3 left-padded by 17 tokens. One graph for
    every decode step; every step's logits match eager OScaR on the same tokens (teacher forcing). In float32: in bf16,
    Inductor's roundings differ from eager's by ~1e-2 (transformers' StaticCache alone: up to 0.016 on this model), and
    every block flushed in a compiled step then quantizes slightly different K/V, flipping ~1% of its 2-bit codes, so
    the two paths drift apart with each flush (0.045-0.061 after 600 steps on an H200) without either being wrong."""
    model = _tiny_gemma3(64, vocab_size=1000, hidden_size=512, intermediate_size=1024, num_attention_heads=8)
    model = model.to(DEVICE)
    prompt = torch.randint(3, 1000, (batch, prompt_length), device=DEVICE)
    mask = torch.ones_like(prompt)
    if batch > 1:
        prompt[1:, :17], mask[1:, :17] = 0, 0
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = _generate(model, prompt, mask, 600, compiled=True)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert not torch._dynamo.utils.counters["graph_break"]
    cache = compiled.past_key_values
    assert [type(layer).__name__ for layer in cache.layers] == ["CompiledSlidingWindowLayer", "OscarLayer"] * 2
    tokens = compiled.sequences[:, prompt_length:]
    eager = _generate(model, prompt, mask, 600, False, teacher_forcing(tokens, prompt_length))
    assert torch.equal(eager.sequences, compiled.sequences)
    config = cache.oscar_config  # the default: bits="auto" (widths chosen after the prefill), 4 sinks
    _assert_float32_logits_match(compiled, eager, prompt_length, config.residual_length)
    for a, b in zip(cache.layers, eager.past_key_values.layers):
        assert a.get_seq_length() == b.get_seq_length() == prompt_length + 599  # compiled lengths read back
        if a.is_sliding:  # the same window, in the same order (bf16 K/V of differently compiled layers below)
            assert ((a.keys.float() - b.keys.float()).norm() / b.keys.float().norm()).item() < 2e-2
        else:
            held = prompt_length + 598 - config.sink_tokens  # tokens before the newest, less the sinks
            assert a.quantized_length == b.quantized_length == held // config.residual_length * config.residual_length


@pytest.mark.parametrize("options", [{}, {"bits": 2, "sink_tokens": 0}], ids=["default", "K2V2-no-sinks"])
def test_a_compiled_step_has_no_input_aliasing_another(tiny_llama, options):
    """Inductor runs a step without CUDA graphs when the graph mutates an input that aliases another input: with sinks,
    the window held as a view of the exact buffers did so (every step 3.5x slower on an H200). The graph's tensor
    inputs (parameters and the cache's buffers) must be distinct storages, whatever the default's widths and sinks."""
    model = tiny_llama(
        torch.bfloat16, vocab_size=101, hidden_size=256, intermediate_size=256, head_dim=64, num_hidden_layers=1
    ).to(DEVICE)
    model.config._attn_implementation = "sdpa"
    prompt = torch.randint(3, 101, (1, 40), device=DEVICE)
    inputs = []

    def inspecting_backend(graph, example_inputs):
        inputs.append([t for t in example_inputs if isinstance(t, torch.Tensor) and t.numel()])
        return graph.forward

    config = OscarConfig(attention="auto" if DEVICE.type == "cuda" else "fused", residual_length=32, **options)
    cache = OscarCache(model.config, config)
    cache.reserve(prompt.shape[1] + 4)
    torch._dynamo.reset()
    step = torch.compile(model.forward, fullgraph=True, backend=inspecting_backend)
    with torch.no_grad():
        token = model(prompt, **cache_kwargs(cache), use_cache=True).logits[:, -1:].argmax(-1)
        cache.choose_bits()  # bits="auto" (the default): the widths before a compiled step
        step(input_ids=token, **cache_kwargs(cache), use_cache=True)
    assert len(inputs) == 1 and cache.layers[0].storage.sinks == config.sink_tokens
    storages = [t.untyped_storage().data_ptr() for t in inputs[0]]
    assert len(set(storages)) == len(storages)


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "eager"])
def test_decode_steps_never_synchronise_the_host(tiny_llama, compiled):
    """Compiled (the manual route of the README) and eager fused decode: 200 steps across a block flush run with CUDA's
    sync debug mode set to raise on any host-device synchronisation (eager flushes check their block's finiteness
    without waiting for it)."""
    model = tiny_llama(
        torch.bfloat16, vocab_size=1000, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, head_dim=128, max_position_embeddings=2048,
    ).to(DEVICE)  # fmt: skip
    model.config._attn_implementation = "sdpa"
    prompt = torch.randint(3, 1000, (2, 100), device=DEVICE)
    cache = OscarCache(model.config, OscarConfig(bits=2, sink_tokens=0))
    cache.reserve(prompt.shape[1] + 210)
    torch._dynamo.reset()
    decode_step = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True) if compiled else model.forward
    with torch.no_grad():
        token = model(prompt, **cache_kwargs(cache), use_cache=True).logits[:, -1:].argmax(-1)
        for _ in range(5):  # compile, warm up, record the CUDA graph
            token = decode_step(input_ids=token, **cache_kwargs(cache), use_cache=True).logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(200):  # tokens 105..304: the flush of block [128, 256) happens on the way
                token = decode_step(input_ids=token, **cache_kwargs(cache), use_cache=True).logits[:, -1:].argmax(-1)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert cache.get_seq_length() == 305 and cache.layers[0].quantized_length == 256


@pytest.mark.gpu
def test_eager_decode_refuses_a_non_finite_block_at_the_next_step(tiny_llama):
    """A block that an eager decode step flushes is checked without waiting: the error comes from the first step
    whose update finds the block's flags arrived (here the next one: the loop synchronises after every token, as
    `generate` does), naming the cause."""
    model = tiny_llama(torch.bfloat16, head_dim=128, hidden_size=256).to(DEVICE)
    model.config._attn_implementation = "sdpa"
    poison = {"position": None}

    def nan_key(module, args, output):  # the model produces a NaN key for one token
        if poison["position"] == 125:
            output[..., 7] = float("nan")
        return output

    model.model.layers[0].self_attn.k_proj.register_forward_hook(nan_key)
    cache = OscarCache(model.config, OscarConfig(method="paper", bits=2, sink_tokens=0))
    refused_at = None
    with torch.no_grad():
        token = model(torch.randint(3, 97, (2, 120), device=DEVICE), **cache_kwargs(cache)).logits[:, -1:].argmax(-1)
        for position in range(120, 140):  # the step of token 128 flushes block [0, 128)
            poison["position"] = position
            try:
                token = model(input_ids=token, **cache_kwargs(cache)).logits[:, -1:].argmax(-1)
            except ValueError as error:
                assert "non-finite keys or values" in str(error)
                refused_at = position
                break
            torch.cuda.synchronize()
    assert refused_at == 129


@pytest.mark.slow_on_cpu  # ~22 s in the interpreter; the default config's sinks compile in the default run
def test_compiled_decode_with_sinks_matches_eager(tiny_llama):
    """sink_tokens=4 on a batch whose row 1 has 2 padding positions: 4 sink slots, each row's own first real tokens;
    the 5-token prompt holds 3 of row 1's, so the first compiled step writes its last sink into its slot (row 0's
    token goes to the window). Later steps fill the window, one flushes a block into the quantized region after the
    sinks (the flush's count and padding columns offset by them, row 1's copy of its sink left out), and the kernel
    reads the quantized region, the sinks and the window, the padding mask put in that order on the device."""
    model = tiny_llama(
        torch.bfloat16, vocab_size=101, hidden_size=256, intermediate_size=256, head_dim=64, num_hidden_layers=1
    ).to(DEVICE)
    model.config._attn_implementation = "sdpa"
    prompt = torch.randint(3, 101, (2, 5), device=DEVICE)
    mask = torch.ones_like(prompt)
    prompt[1, :2], mask[1, :2] = 0, 0
    options = dict(attention="auto" if DEVICE.type == "cuda" else "fused", residual_length=32, sink_tokens=4, bits=2)

    def decode(forward, steps=36):
        cache = OscarCache(model.config, OscarConfig(**options))
        cache.set_padding(mask)
        cache.reserve(prompt.shape[1] + steps)
        attention_mask, logits = mask, []
        with torch.no_grad():
            out = model(prompt, attention_mask=attention_mask, **cache_kwargs(cache), use_cache=True)
            for _ in range(steps):
                token = out.logits[:, -1:].argmax(-1)
                attention_mask = torch.cat([attention_mask, torch.ones_like(token)], 1)
                out = forward(input_ids=token, attention_mask=attention_mask, **cache_kwargs(cache), use_cache=True)
                logits.append(out.logits[:, -1].float())
        return logits, cache

    eager_logits, _ = decode(model.forward)
    torch._dynamo.reset()
    logits, cache = decode(torch.compile(model.forward, fullgraph=True, backend="aot_eager"))
    for a, b in zip(logits, eager_logits):
        torch.testing.assert_close(a, b, atol=1e-2, rtol=1e-2)
    layer = cache.layers[0]
    assert layer.storage.sinks == 4 and layer.get_seq_length() == 41 and layer.quantized_length == 32


def _auto_bits_llama(tiny_llama):
    """A random two-layer Llama for bits="auto" (sdpa, head_dim 64), and the budget of one upgrade of one layer's keys
    or values (2 to 4 bits: the default `auto_widths`) over 2-bit everywhere, so that the layers end with different
    widths."""
    model = tiny_llama(
        torch.bfloat16, vocab_size=101, hidden_size=256, intermediate_size=256, head_dim=64, num_hidden_layers=2
    )
    model.config._attn_implementation = "sdpa"
    low, one = (average_bits(OscarConfig(key_bits=k, sink_tokens=0), 64, 2) for k in (2, 4))
    return model.to(DEVICE), (low + one) / 2


def test_generate_auto_compiles_auto_bits_with_the_widths_chosen_after_the_prefill(tiny_llama):
    """bits="auto": generate chooses the widths after its eager prefill (its 64 quantized tokens stored again at them),
    before the first compiled step, which reserves its storage at those widths: one graph, the eager tokens."""
    model, budget = _auto_bits_llama(tiny_llama)
    prompt = torch.randint(3, 101, (1, 70), device=DEVICE)
    cache_config = {"attention": "auto" if DEVICE.type == "cuda" else "fused", "residual_length": 32}
    options = dict(
        cache_implementation="oscar",
        cache_config={**cache_config, "bits": "auto", "avg_bits": budget},
        do_sample=False,
        max_new_tokens=8,
        min_new_tokens=8,
    )
    eager = _assert_auto_compile_matches_eager(model, prompt, options)
    widths = {(layer.config.key_bits, layer.config.value_bits) for layer in eager.past_key_values.layers}
    assert len(widths) == 2 and (2, 2) in widths, widths


def test_a_compiled_step_refuses_auto_bits_not_chosen_yet(tiny_llama):
    model, budget = _auto_bits_llama(tiny_llama)
    prompt = torch.randint(3, 101, (1, 40), device=DEVICE)
    torch._dynamo.reset()
    compiled = torch.compile(model.forward, fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match=r"widths are not chosen yet.*cache.choose_bits\(\)"):
        _decode(model, compiled, prompt, 1, attention="fused", bits="auto", avg_bits=budget, residual_length=32)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 3])
def test_compiled_generate_with_auto_bits_matches_eager_generate(tiny_llama, teacher_forcing, batch):
    """bits="auto" under generate's automatic compile (Inductor, CUDA graphs): both runs choose the same widths and key
    rotations after the prefill, compile one graph, and every step's logits match eager on the same tokens."""
    model, prompt, mask = _gqa_llama_and_prompt(tiny_llama, batch, padding=17)
    options = {"bits": "auto", "avg_bits": 4.1}
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = _generate(model, prompt, mask, 300, compiled=True, cache_config=options)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    tokens = compiled.sequences[:, prompt.shape[1] :]
    eager = _generate(model, prompt, mask, 300, False, teacher_forcing(tokens, prompt.shape[1]), cache_config=options)
    for a, b in zip(compiled.past_key_values.layers, eager.past_key_values.layers):
        assert (a.config.key_bits, a.config.value_bits) == (b.config.key_bits, b.config.value_bits)
        assert torch.equal(a.key_rotated, b.key_rotated)
    assert compiled.past_key_values.average_bits() <= 4.1
    _assert_logits_match(compiled, eager, tokens)
