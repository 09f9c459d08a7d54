"""Chunked prefill (`generate(prefill_chunk_size=...)`) with generate's automatic compile (issue 37): the chunks run
eagerly into the OscarCache, the decode steps that follow compiled, and the tokens are eager generate's. On CPU
through `_compile_all_devices` (aot_eager, kernels in Triton's interpreter); on a GPU with generate's own compile
(Inductor, CUDA graphs)."""

import pytest
import torch
import torch._dynamo
from devices import DEVICE, slow_on_cpu
from transformers.generation import CompileConfig


def _model(tiny_llama, **overrides):
    options = dict(vocab_size=101, hidden_size=256, intermediate_size=256, head_dim=64, num_hidden_layers=1)
    model = tiny_llama(torch.bfloat16, **{**options, **overrides}).to(DEVICE)
    model.config._attn_implementation = "sdpa"
    return model


def _generate(model, prompt, mask, compile_config, chunk, new_tokens, cache_config=None, **options):
    options.update(dict(disable_compile=True) if compile_config is None else dict(compile_config=compile_config))
    return model.generate(
        prompt,
        attention_mask=mask,
        cache_implementation="oscar",
        cache_config=cache_config,
        prefill_chunk_size=chunk,
        do_sample=False,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        **options,
    )


@pytest.mark.parametrize("method", ["oscar", slow_on_cpu("paper")])
def test_chunked_prefill_then_auto_compiled_decode_equals_eager(tiny_llama, method):
    """A left-padded batch prefilled in chunks of 40 (not a multiple of the 32-token window) across block flushes,
    then compiled decode: one graph (the decode step's), no graph break, eager generate's tokens."""
    model = _model(tiny_llama)
    prompt = torch.randint(3, 101, (2, 100), device=DEVICE)
    mask = torch.ones_like(prompt)
    prompt[1, :5], mask[1, :5] = 0, 0
    attention = "auto" if DEVICE.type == "cuda" else "fused"
    config = dict(attention=attention, residual_length=32, method=method)
    eager = _generate(model, prompt, mask, None, 40, 8, config)
    compile_config = CompileConfig(fullgraph=True, backend="aot_eager", mode=None)
    compile_config._compile_all_devices = True
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = _generate(model, prompt, mask, compile_config, 40, 8, config)
    assert torch.equal(compiled, eager)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert not torch._dynamo.utils.counters["graph_break"]


@pytest.mark.gpu
@pytest.mark.parametrize("chunk", [300, 512])
def test_chunked_prefill_with_generate_auto_compile_matches_eager_on_cuda(tiny_llama, teacher_forcing, chunk):
    """generate's own automatic compile (Inductor, CUDA graphs, fullgraph) after a chunked prefill of 1000 tokens
    (chunks of 300 leave the window boundary inside chunks; the Triton dequantization builds each chunk's history),
    200 decode steps: every step's logits within bf16 rounding of eager generate's with the same chunks on the same
    tokens (teacher forcing), and each compiled token the eager argmax wherever the eager top-2 margin is decisive."""
    model = _model(
        tiny_llama, vocab_size=1000, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, head_dim=128, max_position_embeddings=4096,
    )  # fmt: skip
    prompt = torch.randint(3, 1000, (3, 1000), device=DEVICE)
    mask = torch.ones_like(prompt)
    prompt[1:, :57], mask[1:, :57] = 0, 0
    logged = dict(output_logits=True, return_dict_in_generate=True)
    torch._dynamo.reset()
    compiled = _generate(model, prompt, mask, CompileConfig(fullgraph=True), chunk, 200, **logged)
    tokens = compiled.sequences[:, prompt.shape[1] :]
    forcing = teacher_forcing(tokens, prompt.shape[1])
    eager = _generate(model, prompt, mask, None, chunk, 200, logits_processor=forcing, **logged)
    for step, (a, b) in enumerate(zip(compiled.logits, eager.logits)):
        a, b = a.float(), b.float()
        assert ((a - b).norm() / b.norm()).item() < 2e-2, step  # bf16 outputs of differently split attention
        top2 = b.topk(2, dim=-1).values
        decisive = (top2[:, 0] - top2[:, 1]) > 4 * (a - b).abs().amax()
        assert torch.equal(tokens[decisive, step], b.argmax(-1)[decisive]), step
