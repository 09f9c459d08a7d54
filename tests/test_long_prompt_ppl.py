"""benchmarks/long_prompt_ppl.py: the long-prompt protocol on a tiny random model, against a direct computation."""

import math

import long_prompt_ppl  # benchmarks/ is on pytest's pythonpath (pyproject.toml)
import pytest
import torch
import torch.nn.functional as F

from oscar_hf import OscarCache, OscarConfig, cache_kwargs
from oscar_hf.integrations.lm_eval import effective_avg_bits
from oscar_hf.methods import METHODS

PROMPT, SCORED, CHUNK = 256, 128, 64


def direct_nll(model, ids: torch.Tensor, cache) -> torch.Tensor:
    """The protocol written out: prefill, choose the widths, then two 64-token chunks, each position's NLL."""
    model(ids[:, :PROMPT], **cache_kwargs(cache))
    if isinstance(cache, OscarCache):
        cache.choose_bits()
    first = model(ids[:, PROMPT : PROMPT + CHUNK], **cache_kwargs(cache)).logits[0]
    second = model(ids[:, PROMPT + CHUNK : PROMPT + SCORED], **cache_kwargs(cache)).logits[0]
    return F.cross_entropy(torch.cat([first, second]), ids[0, PROMPT + 1 :], reduction="none").double()


def test_compare_is_the_perplexity_ratio_with_a_paired_chunk_standard_error():
    """Two documents of two 2-token chunks: NLL differences per chunk 0.1, 0.3 (first document), 0.0, 0.2."""
    reference = [torch.tensor([1.0, 2.0, 1.0, 2.0]), torch.tensor([3.0, 1.0, 1.0, 1.0])]
    nll = [torch.tensor([1.1, 2.1, 1.2, 2.4]), torch.tensor([3.0, 1.0, 1.1, 1.3])]
    row = long_prompt_ppl.compare(nll, reference, chunk=2)
    ratio = math.exp(0.15)  # mean NLL 1.65 against 1.5
    assert row["ppl"] == pytest.approx(math.exp(1.65))
    assert row["ppl_change_pct"] == pytest.approx(100 * (ratio - 1))
    units = torch.tensor([0.1, 0.3, 0.0, 0.2], dtype=torch.float64)
    assert row["se_pct"] == pytest.approx(100 * ratio * units.std().item() / 2)
    assert row["chunks"] == 4
    assert row["doc_change_pct"] == pytest.approx([100 * math.expm1(0.2), 100 * math.expm1(0.1)])


def test_the_protocol_scores_the_continuation_through_each_cache(tiny_llama):
    """bf16 scores what one forward over the whole text scores; an OScaR config what the protocol written out scores
    (and not bf16's: its prompt is quantized); bits="auto" chose its widths within its budget after the prefill."""
    torch.manual_seed(0)
    model = tiny_llama()
    docs = [torch.randint(3, model.config.vocab_size, (1, PROMPT + SCORED + 1)) for _ in range(2)]
    methods = ["bf16", "oscar-int2", "oscar-auto-3.6"]
    rows = long_prompt_ppl.measure(model, methods, docs, PROMPT, CHUNK)
    with torch.no_grad():
        exact = [
            F.cross_entropy(model(ids).logits[0, PROMPT:-1], ids[0, PROMPT + 1 :], reduction="none").double()
            for ids in docs
        ]
        int2 = [
            direct_nll(model, ids, OscarCache(model.config, OscarConfig(**METHODS["oscar-int2"][1]))) for ids in docs
        ]
    assert rows["bf16"]["ppl"] == pytest.approx(math.exp(torch.cat(exact).mean().item()), rel=1e-5)
    assert rows["bf16"]["ppl_change_pct"] == 0 and rows["bf16"]["se_pct"] == 0
    ratio = math.exp((torch.cat(int2).mean() - torch.cat(exact).mean()).item())
    assert rows["oscar-int2"]["ppl_change_pct"] == pytest.approx(100 * (ratio - 1), abs=1e-3)
    assert abs(rows["oscar-int2"]["ppl_change_pct"]) > 1e-2  # the quantized prompt moved it
    heads, dim = model.config.num_key_value_heads, model.config.head_dim
    assert rows["oscar-int2"]["effective_bits"] == effective_avg_bits(
        "oscar-int2", METHODS["oscar-int2"][1], dim, heads, PROMPT + SCORED
    )
    auto = rows["oscar-auto-3.6"]
    assert len(auto["widths"]) == len(docs) and all(len(w) == model.config.num_hidden_layers for w in auto["widths"])
    assert auto["stored_bits"] <= 3.6 and auto["effective_bits"] > auto["stored_bits"]


def test_a_diagnosis_row_pins_every_layer_and_one_apart(tiny_llama):
    """`@K2V2/1=K4V2`: bits="auto" stores every layer at K2V2 but layer 1, at K4V2, whatever its costs say."""
    torch.manual_seed(0)
    model = tiny_llama()
    ids = torch.randint(3, model.config.vocab_size, (1, PROMPT + SCORED + 1))
    layers = model.config.num_hidden_layers
    for variant, expected in (("K4V2", ["K4V2"] * layers), ("K2V2/1=K4V2", ["K2V2", "K4V2"] + ["K2V2"] * (layers - 2))):
        _, cache = long_prompt_ppl.document_nll(model, f"oscar-auto-3.6@{variant}", ids, PROMPT, CHUNK)
        assert long_prompt_ppl.widths(cache) == expected
