"""benchmarks/three_bit_probe.py: its rows store the widths they name, through the widths the config supports."""

import long_prompt_ppl  # benchmarks/ is on pytest's pythonpath (pyproject.toml)
import three_bit_probe
import torch

from oscar_hf.layout import StorageLayout


def test_probe_rows_store_three_bit_codes(tiny_llama, monkeypatch):
    """A K3V2 row (`METHODS`' own) stores 3-bit key codes (3 rows per 32 tokens) and counts them (`average_bits`); a
    `-w234` row, bits="auto" among the supported widths, chooses width 3 somewhere."""
    three_bit_probe.install(monkeypatch.setattr, monkeypatch.setitem)
    assert long_prompt_ppl.RECORD.format("m") == "three_bit_probe_m.json"  # run_accuracy.py's tables stay apart
    torch.manual_seed(0)
    model = tiny_llama()
    ids = torch.randint(3, model.config.vocab_size, (1, 385))
    _, fixed = long_prompt_ppl.document_nll(model, "oscar-k3v2-sinks4", ids, 256, 64)
    layer = fixed.layers[0]
    assert (layer.config.key_bits, layer.config.value_bits) == (3, 2)
    quantized = layer.quantized()
    tokens = quantized.value_scale.shape[2]
    assert tokens > 0 and quantized.key_codes.shape[2] * 32 == 3 * tokens
    assert StorageLayout.unpack_codes(quantized.key_codes, 3).max() > 3  # the third bit is used
    assert fixed.average_bits() == 3.5 + 2 * 32 / (2 * 2 * 32 * 2)  # codes + fp16 params, a float32 norm a token
    _, chosen = long_prompt_ppl.document_nll(model, "oscar-auto-3.6-sinks4-w234", ids, 256, 64)
    assert 3 in {bits for pair in long_prompt_ppl.chosen_widths(chosen) for bits in pair}
