"""Shared fixtures: a tiny random Llama, the real offline SmolLM2, and an independent float64 oracle of OScaR."""

import math
import os

import torch

# Without a GPU the Triton kernels run in Triton's interpreter. Triton reads this when it is first imported (which
# importing oscar_hf/transformers can do), so it is set before anything below imports it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# pytest-xdist's workers (`-n 2`) share the cores: each takes its share of torch's threads. With torch's default (every
# core in every worker), two workers on two cores run four OpenMP threads, and each small op of a tiny model waits
# for a descheduled sibling thread: a tiny-Llama generate took 40 s instead of 0.6 s on a busy 2-core machine.
torch.set_num_threads(max(1, torch.get_num_threads() // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", 1))))

import pytest  # noqa: E402
from transformers import (  # noqa: E402
    Gemma3ForCausalLM,
    Gemma3nTextConfig,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3NextConfig,
)

from oscar_hf import OscarCache, OscarConfig, OscarLayer  # noqa: E402


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects
def pytest_collection_modifyitems(items):
    """`slow_on_cpu` tests are slow where the kernels run in Triton's interpreter, and default ones on a GPU."""
    if not torch.cuda.is_available():
        for item in items:
            if item.get_closest_marker("slow_on_cpu"):
                item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def tiny_llama():
    """Factory for a tiny random Llama (GQA 2:1, head_dim 32) for plumbing tests; keyword arguments override the
    config (e.g. vocab_size)."""

    def make(dtype=torch.float32, **overrides) -> LlamaForCausalLM:
        options = dict(
            vocab_size=97,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            max_position_embeddings=2048,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        )
        options.update(overrides)
        return LlamaForCausalLM(LlamaConfig(**options)).to(dtype).eval()

    return make


def _tiny_gemma() -> dict:
    """The tiny Gemma 3 / Gemma 3n hybrids' shared shape (a new dict: each config owns its `layer_types` list)."""
    return dict(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    )


@pytest.fixture
def one_layer_config() -> LlamaConfig:
    """A one-layer Llama config (2 query heads on 1 KV head, head_dim 64) on sdpa, for caches filled by hand."""
    config = LlamaConfig(
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=64, hidden_size=128
    )
    config._attn_implementation = "sdpa"
    return config


@pytest.fixture
def gemma3_config():
    """A tiny Gemma-3-style hybrid: sliding-window and full-attention layers alternate."""
    return Gemma3TextConfig(**_tiny_gemma())


@pytest.fixture(scope="session")
def tiny_gemma3():
    """Factory for a tiny random Gemma 3 causal LM of `_tiny_gemma`'s shape; keyword arguments override the config
    (e.g. layer_types)."""

    def make(**overrides) -> Gemma3ForCausalLM:
        options = {**_tiny_gemma(), **overrides}
        options["num_hidden_layers"] = len(options["layer_types"])
        return Gemma3ForCausalLM(Gemma3TextConfig(**options)).eval()

    return make


@pytest.fixture
def gemma3n_config():
    """A tiny Gemma-3n-style hybrid whose last two layers reuse the K/V of the last sliding and full layers."""
    return Gemma3nTextConfig(
        **_tiny_gemma(),
        vocab_size_per_layer_input=97,
        hidden_size_per_layer_input=8,
        num_kv_shared_layers=2,
        laurel_rank=8,
        activation_sparsity_pattern=[0.0] * 4,
    )


@pytest.fixture
def qwen3next_config():
    """A tiny Qwen3-Next: three linear-attention (gated delta rule) layers, then a full-attention one; MoE MLPs."""
    return Qwen3NextConfig(
        vocab_size=97,
        hidden_size=128,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        linear_num_value_heads=2,
        linear_num_key_heads=2,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
    )


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct, float32, offline (installed and converted by oscar_hf.offline_models on first use)."""
    from oscar_hf.offline_models import load_model

    return load_model("smollm2-135m", dtype=torch.float32)


def _sylvester_hadamard(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def oscar_oracle(
    keys: torch.Tensor,
    values: torch.Tensor,
    config: OscarConfig,
    valid: torch.Tensor | None = None,
    queries: torch.Tensor | None = None,
    prompt: torch.Tensor | None = None,
):
    """What OScaR stores for tokens [0, N) (N a multiple of the group size), written independently of the package:
    a dense Sylvester Hadamard matrix, explicit group reshapes, float64 throughout except where the storage itself
    rounds (scales/mins to scale_dtype, token norms to float32). method="oscar": each (batch row, KV head) rotates
    its keys iff that lowers the attention-logit error of `queries` ([B, Hq, Tq, D], the prompt's) over the keys of
    `prompt` ([B, H, P, D], any P, no padding: the cache's prompt; default `keys`, with `valid`), each query's errors
    centred over those keys; the key groups of the prompt start at its first token, a last partial group holding the
    tokens it has. `valid` ([B, N] bool): padding (False) enters no min/max, mean or cost, stores code 0 and norm 1,
    and a group of padding only stores scale 0 and min 0."""
    k, v = keys.double(), values.double()
    g, sd = config.group_size, config.scale_torch_dtype
    eye = torch.eye(k.shape[-1], dtype=torch.float64)
    rot = _sylvester_hadamard(k.shape[-1]) if config.rotation else eye
    b, h, n, d = k.shape
    real = torch.ones(b, n, dtype=torch.bool) if valid is None else valid
    k = torch.where(real[:, None, :, None], k, 0.0)  # padding's content never matters: drop NaN/inf before any matmul
    v = torch.where(real[:, None, :, None], v, 0.0)

    def fake_quant(x, ok, bits):  # quantize/dequantize groups along the last dim; `ok` marks the valid elements
        levels = 2**bits - 1
        mn = torch.where(ok, x, math.inf).amin(-1, keepdim=True)
        mx = torch.where(ok, x, -math.inf).amax(-1, keepdim=True)
        empty = ~ok.any(-1, keepdim=True)
        mn, mx = torch.where(empty, 0.0, mn).to(sd).double(), torch.where(empty, 0.0, mx)
        scale = ((mx - mn) / levels).to(sd).double()
        codes = torch.where(scale > 0, ((x - mn) / scale).round().clamp(0, levels), torch.zeros_like(x))
        return torch.where(ok, codes, 0.0) * scale + mn

    def token_norms(k, ok):
        if not config.token_scaling:
            return torch.ones(k.shape[0], 1, k.shape[2], 1, dtype=torch.float64)
        norms = k.pow(2).sum(dim=(1, 3)).sqrt()[:, None, :, None]
        return torch.where((norms > 0) & ok[:, None, :, None], norms, torch.ones_like(norms))

    def keys_round_trip(k, rot, ok):  # per (batch, head) rotation matrices rot [B, H, D, D]
        norms = token_norms(k, ok)
        u = (k @ rot) / norms
        b, h, n, d = u.shape
        grouped_ok = ok[:, None, :, None].expand(b, h, n, d).reshape(b, h, n // g, g, d).transpose(-1, -2)
        u_hat = fake_quant(u.reshape(b, h, n // g, g, d).transpose(-1, -2), grouped_ok, config.key_bits)
        u_hat = u_hat.transpose(-1, -2).reshape(b, h, n, d)
        return (u_hat * norms.float().double()) @ rot.transpose(-1, -2)  # the norms are stored in float32

    rot_k = rot.expand(b, h, d, d)
    if config.rotation and config.method == "oscar" and n:
        first, ok = (k, real) if prompt is None else (prompt.double(), torch.ones(b, prompt.shape[2], dtype=torch.bool))
        partial = -first.shape[2] % g  # the last group's missing tokens: padding, in no min/max, mean or cost
        first = torch.cat([first, first.new_zeros(b, h, partial, d)], 2)
        ok = torch.cat([ok, ok.new_zeros(b, partial)], 1)
        w = ok[:, None, :, None].double()
        q = queries.double()
        q = q.reshape(b, h, q.shape[1] // h * q.shape[2], d)  # query head j reads KV head j // group

        def logit_error(m):
            error = (keys_round_trip(first, m.expand(b, h, d, d), ok) - first) * w
            centred = (error - error.sum(2, keepdim=True) / w.sum(2, keepdim=True).clamp(min=1)) * w
            return (q @ centred.transpose(-1, -2)).pow(2).sum((2, 3))

        rot_k = torch.where((logit_error(rot) < logit_error(eye))[:, :, None, None], rot, eye)
    value_ok = real[:, None, :, None, None].expand(b, h, n, d // g, g)
    v_hat = fake_quant((v @ rot).reshape(b, h, n, d // g, g), value_ok, config.value_bits).reshape(b, h, n, d)
    return keys_round_trip(k, rot_k, real), v_hat @ rot.T


@pytest.fixture
def oracle():
    return oscar_oracle


class ExactOscarLayer(OscarLayer):
    """Test hook: quantization made lossless. Blocks are still quantized and stored (so storage, growth and the
    flush schedule run), but reading the quantized region returns the exact tokens that went in. Everything else
    (residual window, flushes, positions, masks, crop, beam reordering) is the real code."""

    def __init__(self, config):
        super().__init__(config)
        self.exact = None  # (keys, values) of the quantized region, exact

    def _quantize(self, keys, values, start):
        if self.exact is None:
            self.exact = (keys.clone(), values.clone())  # may be the residual buffer, which gets overwritten
        else:
            self.exact = tuple(torch.cat([old[:, :, :start], new], 2) for old, new in zip(self.exact, (keys, values)))
        return super()._quantize(keys, values, start)

    def _dequantize(self, start, end, out=None):
        exact = tuple(t[:, :, start:end] for t in self.exact)
        if out is None:
            return exact
        for dense, tokens in zip(out, exact):
            dense.copy_(tokens)
        return out

    def _apply(self, fn):
        super()._apply(fn)
        if self.exact is not None:
            self.exact = tuple(fn(t) for t in self.exact)

    def reset(self):
        super().reset()
        self.exact = None


class ExactOscarCache(OscarCache):
    layer_class = ExactOscarLayer


@pytest.fixture
def exact_oscar_cache():
    return ExactOscarCache
