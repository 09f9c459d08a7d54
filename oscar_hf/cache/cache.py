"""`OscarCache`: a transformers `Cache` whose full-attention layers are `OscarLayer`s (`layer.py`), which store K/V in
OScaR's 2-bit format. The cache chooses each layer's backend at its first update (`backends.choose_backend`) and
hands it over; compiled decode, the query rule, padding and memory accounting have their own modules here.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PretrainedConfig
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from ..config import OscarConfig
from ..reference import check_head_dim
from .backends import choose_backend, compile_blockers, config_compile_blockers
from .compiled import CompiledSlidingWindowLayer
from .key_rotation import CHOICE_TOKENS
from .layer import OscarLayer
from .layer_bits import check_budget, choose_widths
from .memory import KVMemory, average_bits, kv_memory
from .padding import Padding
from .step import UNATTENDED_STEP, FusedStep, hand_over, step_of


def _refuse_latent_attention(text_config: PretrainedConfig) -> None:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi, MiniCPM3, LongCat, Mistral Large 3...) caches a compressed
    latent shared by all heads (and a rotary part) in place of per-head keys and values; quantizing it per channel and
    per token as K/V would be silently wrong. Such configs name the latent's rank (`kv_lora_rank`) or the rotary part's
    width (`qk_rope_head_dim`)."""
    markers = {name: getattr(text_config, name, None) for name in ("kv_lora_rank", "qk_rope_head_dim")}
    markers = {name: value for name, value in markers.items() if value is not None}
    if markers:
        details = ", ".join(f"{name}={value}" for name, value in markers.items())
        raise ValueError(
            f"OscarCache does not support multi-head latent attention: this {type(text_config).__name__} ({details}) "
            "caches a compressed latent, not per-head keys and values, so OScaR's K/V quantization does not apply. "
            "Use the model's default cache (drop cache_implementation='oscar')."
        )


def _refuse_cross_attention(text_config: PretrainedConfig) -> None:
    """Mllama's text model reads `past_key_values.layers[i].keys` of every layer to find its cross-attention layers'
    image K/V; an `OscarLayer` keeps no dense `keys` tensor to show it."""
    layers = getattr(text_config, "cross_attention_layers", None)
    if layers:
        raise ValueError(
            f"OscarCache does not support models with cross-attention layers: this {type(text_config).__name__} "
            f"(cross_attention_layers={list(layers)}) reads every cache layer's dense `keys` tensor, which 2-bit "
            "layers do not hold. Use the model's default cache (drop cache_implementation='oscar')."
        )


class OscarCache(DynamicCache):
    """A `DynamicCache` whose full-attention layers are `OscarLayer`s; other layer types (sliding window, linear
    attention, KV-sharing) keep transformers' own layers. Where compiled decode may apply, `reserve` (which `generate`
    calls) makes the sliding-window layers static, as `StaticCache` does (`compiled.CompiledSlidingWindowLayer`).

    Args:
        config (`PretrainedConfig`):
            The model's config (`model.config`): the layer types come from it, and its attention implementation
            resolves method="auto" (`OscarConfig.resolve`).
        oscar_config (`OscarConfig` or `dict`, *optional*):
            The cache's options, or a dict of `OscarConfig` fields (unknown keys are an error); None: the defaults.
            `self.oscar_config` is it resolved (method "oscar" or "paper").
        tp_group (`torch.distributed.ProcessGroup`, *optional*):
            Under tensor parallelism, the group over which the KV heads are sharded (default: the whole world, as with
            `torchrun` and `tp_plan="auto"`; `generate` passes the model's own). A layer that sees fewer KV heads than
            the config names all-reduces its token norms over it, so they cover every head, as on one GPU.

    Example:
        >>> cache = OscarCache(model.config, OscarConfig(bits=2))
        >>> model.generate(**inputs, **cache_kwargs(cache))
    """

    layer_class: type[OscarLayer] = OscarLayer

    def __init__(self, config: PretrainedConfig, oscar_config: OscarConfig | dict | None = None, tp_group=None):
        if not isinstance(oscar_config, OscarConfig):
            oscar_config = OscarConfig.from_dict(oscar_config)
        text_config = config.get_text_config(decoder=True)
        # method="auto": the query rule where the model's attention hands the queries over, else the paper's (warned)
        oscar_config = oscar_config.resolve(getattr(text_config, "_attn_implementation", None))
        self.oscar_config = oscar_config
        self._waiting: FusedStep | None = None  # the latest fused step, waiting for its attention
        self.tp_group = tp_group
        self._text_config = text_config
        if getattr(text_config, "is_encoder_decoder", False):
            raise ValueError("OscarCache supports decoder-only models; this model is an encoder-decoder.")
        _refuse_latent_attention(text_config)
        _refuse_cross_attention(text_config)
        head_dim = getattr(text_config, "head_dim", None)
        if isinstance(head_dim, int):
            check_head_dim(head_dim, oscar_config)
        super().__init__(config=config)
        self.layers = [
            self.layer_class(oscar_config) if type(layer) is DynamicLayer else layer for layer in self.layers
        ]
        if not any(isinstance(layer, OscarLayer) for layer in self.layers):
            raise ValueError(
                f"OscarCache found no standard full-attention layer in this {type(config).__name__} (layer types: "
                f"{sorted({type(layer).__name__ for layer in self.layers})}); nothing would be quantized. Use the "
                "model's default cache."
            )
        self._choosing_bits = oscar_config.auto_bits  # bits="auto" until `choose_bits` chose every layer's widths
        if self._choosing_bits:
            heads = getattr(text_config, "num_attention_heads", None) or 1
            self._query_group = heads // (getattr(text_config, "num_key_value_heads", None) or heads)
            check_budget(oscar_config, [self._kv_shape()])

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        layer = self.layers[layer_idx]
        if self._choosing_bits and not torch.compiler.is_compiling() and isinstance(layer, OscarLayer):
            held = layer.get_seq_length()
            # bits="auto" chooses before storing a decode step that follows the prompt, or any update once the cost
            # sums are complete (`CHOICE_TOKENS` held): a long prompt fed in chunks is stored 4-bit no longer
            if (key_states.shape[-2] == 1 and held) or held >= CHOICE_TOKENS:
                self.choose_bits()
        if isinstance(layer, OscarLayer) and not layer.is_initialized:
            head_dims = (key_states.shape[-1], value_states.shape[-1])
            backend = choose_backend(
                self.oscar_config, self._text_config, self.offloading, key_states.device, head_dims, key_states.shape[1]
            )
            layer.configure(backend, self._head_shard_group(key_states))
        # Eager code only: a compiled forward (one graph, sdpa, no KV sharing: `compile_blockers`) always
        # attends through the sdpa entry, and reading this state there would make dynamo guard on it per step.
        eager = not torch.compiler.is_compiling()
        if eager and self._waiting is not None and self._waiting.unattended:
            self._waiting = None
            raise RuntimeError(UNATTENDED_STEP)
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if eager:
            self._waiting = step_of(keys)  # each update is followed by its attention: one waits at most
        # transformers >= 5.24 calls `update(..., kwargs=kwargs)` with the dict its attention call then unpacks: the
        # fused step rides along explicitly (integrations/fused_attention.py)
        hand_over(keys, kwargs.get("kwargs"))
        return keys, values

    def choose_bits(self) -> None:
        """bits="auto": choose every OScaR layer's key and value widths from the prompt it holds, under `avg_bits`
        (`layer_bits.py`, `layer_widths.choose_layer_bits`), store each layer's quantized region at its widths, and say
        which layer got which (logger.info). `generate` calls it after its prefill; by hand, the first decode step
        (a single-token update after the prompt) or the first update past 4096 tokens (`CHOICE_TOKENS`) does, or call it
        once the prompt is in. It does nothing once chosen, nor before every OScaR layer holds tokens."""
        layers = {index: layer for index, layer in enumerate(self.layers) if isinstance(layer, OscarLayer)}
        if self._choosing_bits and choose_widths(layers, self.oscar_config, self._query_group):
            self._choosing_bits = False

    bits_open = property(lambda self: self._choosing_bits, doc="bits='auto': the layers' widths are not chosen yet")

    def reset(self) -> None:
        """Hold nothing; bits="auto" chooses again from the next prompt (storing the widest widths until then)."""
        super().reset()
        self._choosing_bits = self.oscar_config.auto_bits

    def _kv_shape(self) -> tuple[int, int]:
        """(KV heads, head_dim) of the model's full-attention layers, from its config."""
        text_config = self._text_config
        heads = getattr(text_config, "num_attention_heads", None) or 1
        head_dim = getattr(text_config, "head_dim", None) or getattr(text_config, "hidden_size", 0) // heads
        return getattr(text_config, "num_key_value_heads", None) or heads, head_dim

    def average_bits(self) -> float:
        """Stored bits per K/V element of the quantized regions: `oscar_hf.average_bits` of each OScaR layer's widths
        (under bits="auto" the chosen ones, the widest until chosen) at the model's head_dim and KV heads, averaged over
        the layers (all of one shape, so the average weighted by their K/V elements per token)."""
        layers = [layer for layer in self.layers if isinstance(layer, OscarLayer)]
        heads, head_dim = self._kv_shape()
        per_layer = [average_bits(layer.config, head_dim, heads) for layer in layers]
        return sum(per_layer) / len(per_layer)

    def set_padding(self, attention_mask: torch.Tensor | None) -> None:
        """Tell the cache which positions hold padding, so that quantization leaves them out: `attention_mask` is the
        2D mask `[B, positions]` a model takes (1 for real tokens, 0 for padding), its first column the cache's first
        position; positions past its end count as real. Padding keys then enter no key group's min/max nor
        method="oscar"'s rotation choice (`reference.quantize_kv`, `valid`); a group of padding only decodes to zeros.
        With `sink_tokens`, each row's sinks are then its own first real tokens (`padding.Padding`).

        `generate(cache_implementation="oscar")` calls it with the prompt's mask. By hand, call it before the forward
        that brings padded tokens (e.g. a left-padded prompt batch): `cache.set_padding(inputs["attention_mask"])`.
        None (or a mask without zeros) means no padding. Tokens already quantized keep their codes.
        """
        if attention_mask is not None and attention_mask.ndim != 2:
            raise ValueError(
                f"OscarCache.set_padding takes the 2D attention mask [batch, positions] (1 = token, 0 = padding), "
                f"got shape {tuple(attention_mask.shape)}."
            )
        padding = None if attention_mask is None else Padding.of(attention_mask, self.oscar_config.sink_tokens)
        for layer in self.layers:
            if isinstance(layer, OscarLayer):
                layer.set_padding(padding)

    def _head_shard_group(self, key_states: torch.Tensor):
        """The process group over which a layer seeing these keys has its KV heads sharded, or None when this
        process holds all of them (one device, `device_map`, or no torch.distributed)."""
        total, held = getattr(self._text_config, "num_key_value_heads", None), key_states.shape[1]
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        if not isinstance(total, int) or held >= total or not distributed:
            return None
        group = self.tp_group if self.tp_group is not None else torch.distributed.group.WORLD
        ranks = torch.distributed.get_world_size(group)
        if held * ranks != total:
            raise ValueError(
                f"OscarCache: a layer holds {held} of the model's {total} KV heads, but the tensor-parallel group has "
                f"{ranks} ranks ({held} x {ranks} != {total}), so the Omni-Token norm over all heads cannot be "
                "assembled. Pass the group that shards the heads: OscarCache(config, tp_group=...)."
            )
        return group

    @property
    def is_compileable(self) -> bool:
        """Whether decode steps may run compiled (`generate`'s automatic compile checks this, with the device): see
        `compile_blockers`."""
        return not self.compile_blockers()

    def compile_blockers(self) -> list[str]:
        """Why compiled decode cannot run with this model and configuration (empty when it can;
        `backends.compile_blockers`): it needs the Triton backend by the model's config (sdpa, head dims the kernel
        supports, no KV sharing), every other layer able to run compiled (sliding-window layers are made static by
        `reserve`; transformers' linear-attention layers are static already) and the maximum length reserved
        (`generate` reserves it; by hand, `reserve(max_length)` before the prefill). The device (CUDA) is checked by
        `generate` before the prefill, and by each layer at its first update (after which this reports it)."""
        layers = [layer for layer in self.layers if isinstance(layer, OscarLayer)]
        return compile_blockers(
            self.oscar_config,
            self._text_config,
            uncompileable_layers=[
                type(layer).__name__
                for layer in self.layers
                if not isinstance(layer, OscarLayer) and not layer.is_compileable
            ],
            offloading=self.offloading,
            tensor_parallel=self.tp_group is not None or any(layer.head_group for layer in layers),
            backends=[layer.backend for layer in layers if layer.is_initialized],
            reserved=all(layer.max_cache_len is not None for layer in layers),
        )

    def activate_past_recording(self, **kwargs) -> None:
        """Assisted decoding rolls rejected tokens back (`crop`), which a static sliding-window layer past its window
        cannot: the ones `reserve` made static that hold nothing yet go back to transformers' dynamic layers, which
        record their past (decoding eagerly, as without a reservation). `kwargs` (transformers >= 5.25:
        `recurrent_states_to_keep`) go to transformers' own."""
        self.layers = [
            DynamicSlidingWindowLayer(sliding_window=layer.sliding_window)
            if type(layer) is CompiledSlidingWindowLayer and not layer.is_initialized
            else layer
            for layer in self.layers
        ]
        super().activate_past_recording(**kwargs)

    def memory_footprint(self) -> KVMemory:
        """Bytes this cache holds now, and the ratio to a bf16 cache of the same tokens."""
        return kv_memory(self)

    def reserve(self, tokens: int) -> None:
        """Pre-allocate quantized storage for `tokens` tokens in every OScaR layer. Where the model's config and this
        cache allow compiled decode (`backends.config_compile_blockers`), the sliding-window layers that hold
        nothing yet become static ones of `min(window, tokens)` tokens (`compiled.CompiledSlidingWindowLayer`, what
        `StaticCache` builds for them), so that the whole decode step can run compiled; otherwise they stay
        transformers' dynamic layers."""
        for layer in self.layers:
            if isinstance(layer, OscarLayer):
                layer.reserve(tokens)
        if config_compile_blockers(
            self.oscar_config, self._text_config, offloading=self.offloading, tensor_parallel=self.tp_group is not None
        ):
            return
        self.layers = [
            CompiledSlidingWindowLayer(tokens, layer.sliding_window)
            if type(layer) in (DynamicSlidingWindowLayer, CompiledSlidingWindowLayer) and not layer.is_initialized
            else layer
            for layer in self.layers
        ]
