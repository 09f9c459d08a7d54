"""Multimodal and omni-modal models through `generate(cache_implementation="oscar")`, on tiny random configs of the
model classes transformers ships (no weights): LLaVA-NeXT, Qwen2.5-VL, Qwen3-VL, Gemma 3 (image-text, hybrid
sliding layers), Idefics3 (SmolVLM's architecture) and the Qwen2.5-Omni thinker (text + image + audio in).

Inputs are built by hand to each model's spec (pixel values, image grids, audio features, placeholder counts that the
model's own feature extractors produce), so no processor (and no torchvision) is needed.

The cache only sees the language model's K/V: image and audio tokens are ordinary positions of the text decoder once
the encoders have run. What can go wrong is therefore plumbing: finding the text config and its layer types, the
sequence length the model reads positions from (M-RoPE deltas in Qwen-VL/Omni), masks (Gemma 3's bidirectional image
blocks, sliding layers), and a cache reused across two `generate` calls with a second image. The exact-quantization
hook (tests/conftest.py) proves that plumbing token for token; real 2-bit codes then check runs, memory and positions.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from transformers import (
    DynamicCache,
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Idefics3Config,
    Idefics3ForConditionalGeneration,
    LlavaNextConfig,
    LlavaNextForConditionalGeneration,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5OmniThinkerConfig,
    Qwen2_5OmniThinkerForConditionalGeneration,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
)

from oscar_hf import OscarCache, OscarLayer, cache_kwargs

VOCAB = 128  # token ids 3..TEXT_VOCAB are text; the special tokens of every family sit above
TEXT_VOCAB = 100
PAD, BOS, EOS = 0, 1, 2
IMAGE, VIDEO, VISION_START, VISION_END, AUDIO, AUDIO_START, AUDIO_END, BOI, EOI = range(110, 119)
# A small text decoder shared by every family: 2 layers, 4 query heads, 2 KV heads, head_dim 32 (a multiple of the
# group size, so the values' per-token groups are whole).
TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=128,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=4096,
    pad_token_id=PAD,
    bos_token_id=BOS,
    eos_token_id=EOS,
)
SIGLIP = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32, patch_size=4
)
MROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]}  # sums to head_dim / 2
# The Qwen vision tower (2x2 patch merge, 2 frames per temporal patch) and the VL models' special tokens
QWEN_VISION = dict(
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    out_hidden_size=TEXT["hidden_size"],
    patch_size=4,
    spatial_merge_size=2,
    temporal_patch_size=2,
)
QWEN_VL_TOKENS = dict(
    image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VISION_START, vision_end_token_id=VISION_END
)


@dataclass
class Media:
    """One image (or audio clip): its placeholder tokens in the prompt and the tensors the model encodes it from."""

    tokens: torch.Tensor  # [n] token ids, markers included
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------------------------
# Families: a tiny model, and a function making its k-th test image (two sizes, so two images differ in length)


def _count_features(output) -> int:
    features = output.pooler_output
    return sum(len(f) for f in features) if isinstance(features, (list, tuple)) else features.shape[0]


def llava_next():
    config = LlavaNextConfig(
        text_config=dict(model_type="llama", **TEXT),
        vision_config=dict(
            model_type="clip_vision_model",
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=16,
            patch_size=4,
            projection_dim=32,
        ),
        image_token_index=IMAGE,
        image_grid_pinpoints=[[16, 32], [32, 16], [32, 32]],
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        pad_token_id=PAD,
    )
    model = LlavaNextForConditionalGeneration(config).eval()

    def image(k: int) -> Media:
        size = [[32, 32], [16, 32]][k % 2]  # (height, width): any-res tiles of 16 px plus the base image
        patches = 1 + (size[0] // 16) * (size[1] // 16)
        inputs = dict(pixel_values=torch.randn(1, patches, 3, 16, 16), image_sizes=torch.tensor([size]))
        n = _count_features(model.model.get_image_features(**inputs, return_dict=True))
        return Media(torch.full((n,), IMAGE), inputs)

    return model, image


def _qwen_vl_image(model, k: int, patch: int) -> Media:
    grid = [(8, 12), (4, 8)][k % 2]  # patches; 2x2 of them merge into one token
    thw = torch.tensor([[1, *grid]])
    pixels = torch.randn(grid[0] * grid[1], 3 * 2 * patch * patch)  # temporal_patch_size 2
    n = grid[0] * grid[1] // 4
    return Media(torch.tensor([VISION_START, *[IMAGE] * n, VISION_END]), dict(pixel_values=pixels, image_grid_thw=thw))


def qwen2_5_vl():
    config = Qwen2_5_VLConfig(
        text_config=dict(**TEXT, rope_parameters=MROPE),
        vision_config=dict(
            **QWEN_VISION,
            depth=1,
            window_size=16,
            fullatt_block_indexes=[0],
        ),
        **QWEN_VL_TOKENS,
    )
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    return model, lambda k: _qwen_vl_image(model, k, patch=4)


def qwen3_vl():
    config = Qwen3VLConfig(
        text_config=dict(**TEXT, rope_parameters=dict(MROPE, mrope_interleaved=True)),
        vision_config=dict(
            **QWEN_VISION,
            depth=2,
            num_position_embeddings=64,
            deepstack_visual_indexes=[0],
        ),
        **QWEN_VL_TOKENS,
    )
    model = Qwen3VLForConditionalGeneration(config).eval()
    return model, lambda k: _qwen_vl_image(model, k, patch=4)


def gemma3():
    config = Gemma3Config(
        text_config=dict(
            **TEXT,
            sliding_window=16,
            layer_types=["sliding_attention", "full_attention"],
            query_pre_attn_scalar=32,
        ),
        vision_config=dict(SIGLIP),
        mm_tokens_per_image=16,  # 8x8 patches pooled to 4x4
        boi_token_index=BOI,
        eoi_token_index=EOI,
        image_token_index=IMAGE,
    )
    model = Gemma3ForConditionalGeneration(config).eval()
    # Gemma 3 initialises the image projection to zeros (every image would embed to 0); give it random weights
    torch.nn.init.normal_(model.model.multi_modal_projector.mm_input_projection_weight, std=0.5)

    def image(k: int) -> Media:  # one fixed size: Gemma 3 pools every image to mm_tokens_per_image tokens
        n = config.mm_tokens_per_image
        return Media(torch.tensor([BOI, *[IMAGE] * n, EOI]), dict(pixel_values=torch.randn(1, 3, 32, 32)))

    return model, image


def idefics3():
    config = Idefics3Config(
        text_config=dict(model_type="llama", **TEXT),
        vision_config=dict(SIGLIP),
        scale_factor=2,
        image_token_id=IMAGE,
        pad_token_id=PAD,
    )
    model = Idefics3ForConditionalGeneration(config).eval()

    def image(k: int) -> Media:  # SmolVLM splits an image into tiles; each tile is (32/4)^2 / 2^2 = 16 tokens
        tiles = [3, 1][k % 2]
        n = tiles * (32 // 4) ** 2 // config.scale_factor**2
        return Media(torch.tensor([BOI, *[IMAGE] * n, EOI]), dict(pixel_values=torch.randn(1, tiles, 3, 32, 32)))

    return model, image


def qwen2_5_omni_thinker():
    """The thinker (text out from text + image + audio in); the talker speaks, it has no KV cache of ours."""
    config = Qwen2_5OmniThinkerConfig(
        text_config=dict(**TEXT, rope_parameters=MROPE),
        vision_config=dict(
            **QWEN_VISION,
            depth=1,
            window_size=16,
            fullatt_block_indexes=[0],
        ),
        audio_config=dict(
            num_mel_bins=16,
            encoder_layers=1,
            encoder_attention_heads=2,
            encoder_ffn_dim=64,
            d_model=32,
            output_dim=TEXT["hidden_size"],
            n_window=25,
            max_source_positions=200,
        ),
        audio_token_index=AUDIO,
        image_token_index=IMAGE,
        video_token_index=VIDEO,
        audio_start_token_id=AUDIO_START,
        audio_end_token_id=AUDIO_END,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
    )
    model = Qwen2_5OmniThinkerForConditionalGeneration(config).eval()
    return model, lambda k: _qwen_vl_image(model, k, patch=4)


def omni_audio(model, frames: int) -> Media:
    """An audio clip of `frames` mel frames: the encoder's two stride-2 stages give about frames / 4 tokens."""
    mel = model.config.audio_config.num_mel_bins
    _, n = model.model.audio_tower._get_feat_extract_output_lengths(torch.tensor(frames))
    inputs = dict(
        input_features=torch.randn(1, mel, frames), feature_attention_mask=torch.ones(1, frames, dtype=torch.long)
    )
    return Media(torch.tensor([AUDIO_START, *[AUDIO] * int(n), AUDIO_END]), inputs)


FAMILIES = {
    "llava-next": llava_next,
    "qwen2.5-vl": qwen2_5_vl,
    "qwen3-vl": qwen3_vl,
    "gemma3": gemma3,
    "idefics3": idefics3,
    "qwen2.5-omni-thinker": qwen2_5_omni_thinker,
}


# ---------------------------------------------------------------------------------------------------------------
# Conversations: turn 1 puts the first image across the 128-token block boundary, turn 2 (same cache, a second
# `generate` call) adds a second image.

# OscarConfig's default residual_length, the boundary users get: the prompt's first complete block is quantized at
# prefill. Prompts of 150-300 tokens cost little on these tiny models, so nothing is gained by a smaller window.
BLOCK = 128
IMAGE_AT = 120  # the first image starts 8 tokens before the block boundary, so its tokens straddle it
NEW_TOKENS = 8
GREEDY = dict(do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, return_dict_in_generate=True)


def _text(n: int) -> torch.Tensor:
    return torch.randint(3, TEXT_VOCAB, (n,))


def _generate_kwargs(name: str, model, ids: torch.Tensor, media: list[Media], new: int) -> dict:
    """What `generate` needs for prompt `ids`, whose media are `media` in order and `media[new:]` are not cached yet
    (a processor would produce the same tensors)."""
    kwargs = {}
    for item in media[new:]:
        kwargs.update(item.inputs)
    if name in ("qwen2.5-vl", "qwen3-vl"):
        # M-RoPE positions are computed from the whole conversation: every image's grid, and which tokens are images.
        kwargs["mm_token_type_ids"] = (ids == IMAGE).int()
        kwargs["image_grid_thw"] = torch.cat([m.inputs["image_grid_thw"] for m in media])
        if new:  # pixels of the new image only, encoded up front: the grids above also cover the cached image
            new_pixels, new_grid = kwargs.pop("pixel_values"), media[-1].inputs["image_grid_thw"]
            kwargs["mm_encoder_outputs"] = {"image": model.model.get_image_features(new_pixels, new_grid)}
    if name == "gemma3":
        kwargs["token_type_ids"] = (ids == IMAGE).long()  # image tokens attend to each other bidirectionally
    if name == "qwen2.5-omni-thinker":
        kwargs["attention_mask"] = torch.ones_like(ids)  # the thinker computes its 3D positions only with a mask
    return kwargs


@pytest.fixture(scope="module", params=list(FAMILIES))
def conversation(request):
    """A family's tiny model and a two-turn conversation: (name, model, turns), turns = [(prompt tail, media)]."""
    torch.manual_seed(0)
    name = request.param
    model, image = FAMILIES[name]()
    first, second = image(0), image(1)
    media = [first]
    turn_1 = [_text(IMAGE_AT), first.tokens, _text(10)]
    if name == "qwen2.5-omni-thinker":  # text + image + audio in
        clip = omni_audio(model, 100)
        media.append(clip)
        turn_1 += [clip.tokens, _text(6)]
    turn_2 = [_text(6), second.tokens, _text(5)]
    return name, model, [(torch.cat(turn_1), media), (torch.cat(turn_2), [second])]


class PositionRecorder:
    """Records the position ids the language model's rotary embedding receives (M-RoPE: [3, B, T])."""

    def __init__(self, model):
        self.positions = []
        rotary = model.get_decoder().rotary_emb
        self.handle = rotary.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module, args, kwargs):
        self.positions.append((args[1] if len(args) > 1 else kwargs["position_ids"]).clone())

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.remove()


def _run(name, model, turns, cache_options: dict, first_cache=None) -> dict:
    """Both turns through `generate`; turn 1 builds its cache from `cache_options` (or uses `first_cache`), turn 2
    continues the same cache. Returns sequences, logits, positions, rope deltas and the cache."""
    if hasattr(model.model, "rope_deltas"):  # M-RoPE models keep the deltas of the last prompt on the model
        model.model.rope_deltas = None
    ids, media, record = torch.empty(1, 0, dtype=torch.long), [], {"sequences": [], "logits": [], "deltas": []}
    cache = first_cache
    with PositionRecorder(model) as positions:
        for turn, (tail, new_media) in enumerate(turns):
            ids = torch.cat([ids, tail[None]], dim=1)
            new = len(media)
            media = media + new_media
            kwargs = _generate_kwargs(name, model, ids, media, new)
            options = dict(cache_options) if turn == 0 and cache is None else cache_kwargs(cache)
            out = model.generate(ids, **kwargs, **options, **GREEDY, output_logits=True)
            cache, ids = out.past_key_values, out.sequences
            record["sequences"].append(out.sequences)
            record["logits"].append(torch.stack(out.logits))
            record["deltas"].append(getattr(model.model, "rope_deltas", None))
    return dict(record, positions=positions.positions, cache=cache)


@pytest.fixture(scope="module")
def dynamic_run(conversation):
    name, model, turns = conversation
    return _run(name, model, turns, {}, first_cache=DynamicCache(config=model.config))


def test_conversation_puts_modality_tokens_across_the_block_boundary(conversation):
    """The premise of the tests below: the first image's tokens straddle the first 128-token block, so part of the
    image is quantized at prefill and part stays in the residual window; the images change what the model says."""
    name, model, turns = conversation
    prompt, media = turns[0]
    where = (prompt == IMAGE).nonzero().flatten()
    assert where.min() < BLOCK <= where.max()
    kwargs = _generate_kwargs(name, model, prompt[None], media, 0)
    logits = model(prompt[None], **kwargs).logits[0, -1]
    # another image (or audio clip) gives other logits: the media reach the decoder
    others = [Media(m.tokens, {k: _resample(k, v) for k, v in m.inputs.items()}) for m in media]
    other = model(prompt[None], **_generate_kwargs(name, model, prompt[None], others, 0)).logits[0, -1]
    assert not torch.allclose(logits, other)


def test_exact_cache_generate_equals_dynamic_cache(conversation, dynamic_run, exact_oscar_cache, monkeypatch):
    """With quantization made lossless, generate(cache_implementation="oscar") reproduces DynamicCache bit for bit in
    both turns: same tokens, same logits, same positions (M-RoPE included), same rope deltas."""
    name, model, turns = conversation
    monkeypatch.setattr(OscarCache, "layer_class", exact_oscar_cache.layer_class)
    got = _run(name, model, turns, {"cache_implementation": "oscar"})
    for turn in range(2):
        assert torch.equal(got["sequences"][turn], dynamic_run["sequences"][turn])
        assert torch.equal(got["logits"][turn], dynamic_run["logits"][turn])
    assert len(got["positions"]) == len(dynamic_run["positions"])
    assert all(torch.equal(a, b) for a, b in zip(got["positions"], dynamic_run["positions"]))
    assert all(_same(a, b) for a, b in zip(got["deltas"], dynamic_run["deltas"]))
    cache = got["cache"]
    assert type(cache) is OscarCache
    oscar_layers = [layer for layer in cache.layers if isinstance(layer, OscarLayer)]
    assert oscar_layers and all(layer.quantized_length >= BLOCK for layer in oscar_layers)


def _resample(key: str, value: torch.Tensor) -> torch.Tensor:
    return torch.randn_like(value) if key in ("pixel_values", "input_features") else value


def _same(a, b) -> bool:
    return (a is None and b is None) or torch.equal(a, b)


def test_real_codes_generate_with_exact_positions_and_memory_report(conversation, dynamic_run):
    """Real 2-bit codes: both turns run; positions (M-RoPE included) and rope deltas are those of DynamicCache, since
    they depend on where the tokens are, never on what the cache stores; the memory report matches the tensors."""
    name, model, turns = conversation
    options = {"cache_implementation": "oscar", "cache_config": {"bits": 2, "sink_tokens": 0}}
    got = _run(name, model, turns, options)
    cache = got["cache"]
    assert all(torch.isfinite(logits).all() for logits in got["logits"])
    assert not torch.equal(got["logits"][0], dynamic_run["logits"][0])  # the quantized history does change logits
    assert [s.shape for s in got["sequences"]] == [s.shape for s in dynamic_run["sequences"]]
    assert len(got["positions"]) == len(dynamic_run["positions"])
    assert all(torch.equal(a, b) for a, b in zip(got["positions"], dynamic_run["positions"]))
    assert all(_same(a, b) for a, b in zip(got["deltas"], dynamic_run["deltas"]))
    if name in ("qwen2.5-vl", "qwen3-vl"):
        # turn 2 re-derives the deltas from the whole conversation (its second image moves the text after it)
        ids = got["sequences"][1][:, :-NEW_TOKENS]
        grids = torch.cat([m.inputs["image_grid_thw"] for _, media in turns for m in media])
        _, deltas = model.model.get_rope_index(ids, (ids == IMAGE).int(), image_grid_thw=grids)
        assert torch.equal(got["deltas"][1], deltas) and not torch.equal(got["deltas"][0], deltas)
    _check_memory_report(cache, total_tokens=got["sequences"][1].shape[1] - 1)  # the last token is never fed back


def _check_memory_report(cache: OscarCache, total_tokens: int) -> None:
    """`memory_footprint()` against the stored tensors and against the byte count of the storage contract."""
    config = cache.oscar_config
    want = dict(quantized=0, quantized_bf16=0, exact=0, exact_bf16=0)
    for layer in cache.layers:
        if not isinstance(layer, OscarLayer):  # e.g. Gemma 3's sliding-window layers: kept exact
            held = layer.keys.nbytes + layer.values.nbytes
            want["exact"] += held
            want["exact_bf16"] += held // layer.keys.element_size() * 2
            continue
        quantized, residual = layer.quantized_length, layer.residual_length
        assert quantized + residual == total_tokens
        assert quantized == (total_tokens - 1) // config.residual_length * config.residual_length  # residual 1..R
        batch, heads, _, dim = layer.residual_keys.shape
        codes = dim * (config.key_bits + config.value_bits) // 8  # bytes per token and head, K and V at their bits
        key_params = 2 * dim * 2 // config.group_size  # fp16 scale + min per channel, per group of tokens
        value_params = 2 * (dim // config.group_size) * 2  # fp16 scale + min per token, per group of channels
        per_token = heads * (codes + key_params + value_params) + 4  # + one float32 norm shared by the heads
        assert sum(t.nbytes for t in layer.quantized()) == batch * quantized * per_token
        want["quantized"] += batch * quantized * per_token
        want["quantized_bf16"] += batch * quantized * heads * dim * 2 * 2
        want["exact"] += batch * residual * heads * dim * 2 * layer.residual_keys.element_size()
        want["exact_bf16"] += batch * residual * heads * dim * 2 * 2
    memory = cache.memory_footprint()
    assert memory.quantized_bytes == want["quantized"] > 0
    assert memory.quantized_bf16_bytes == want["quantized_bf16"]
    assert memory.exact_bytes == want["exact"]
    assert memory.exact_bf16_bytes == want["exact_bf16"]
    assert memory.allocated_bytes >= memory.total_bytes
