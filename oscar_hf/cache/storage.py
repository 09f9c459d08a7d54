"""What an `OscarLayer` holds: the exact sinks, the quantized region and the residual window (see layer.py's docstring).

The quantized region is packed blocks in the storage contract of `oscar_hf.layout`, in capacity buffers that grow by
doubling (or are reserved once at full size), so that a flush copies one block, never the history. The window is a fixed
buffer of `residual_length` tokens, exact, in the model dtype; the sinks (`sink_tokens`, the first tokens of each
sequence) sit just before it in the same buffer, so that the kernels read the sinks and the window as one run of exact
tokens (attention does not depend on the order of its keys: RoPE is applied already). How a block is quantized and
dequantized (the key rotation, kernels, token norms, finite checks: `blocks.BlockCodec`) is the layer's: `KVStorage`
takes it as two functions.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..layout import QuantizedKV, StorageLayout
from .padding import Padding

# Tokens quantized per call during a long prefill: bounds the float32 temporaries of `quantize_kv`.
QUANTIZE_CHUNK_TOKENS = 4096


class KVStorage:
    """In position order: `sinks_held` exact sink tokens (up to `sinks`), `length` quantized tokens (a multiple of the
    window size R) in `buffers`, then `held` exact tokens (1..R once anything follows the sinks) at the start of the
    window buffers `keys`/`values` (`[B, Hkv, R, D]`). The sinks fill first (`append`). The sinks and the window share
    the buffers `exact_keys`/`exact_values` (`[B, Hkv, sinks + R, D]`; `keys` and `values` are views of their last R
    tokens), so the exact tokens are one run, `exact_tokens()`: the kernels' residual, in storage order
    `[quantized | sinks | window]` (`padding.storage_order` puts a padding mask in it).

    quantize(keys, values, start): write these tokens' block at quantized token `start` (rows made already), now or,
    before anything reads it, later (method="oscar" writes a prompt's blocks once its queries came).
    dequantize(start, end, out=None): dense K/V, in the model dtype, of quantized tokens `[start, end)`
    (block-aligned), written into `out` (a pair of `[B, Hkv, end - start, D]` tensors) when given."""

    def __init__(
        self,
        layout: StorageLayout,
        window: int,
        quantize: Callable[..., None],
        dequantize: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    ):
        self.layout, self.window = layout, window
        self.quantize, self.dequantize = quantize, dequantize
        self.exact_keys: torch.Tensor | None = None  # [B, Hkv, sinks + R, D]: the sinks, then the window
        self.exact_values: torch.Tensor | None = None
        self.sinks = self.sinks_held = self.held = self.length = 0  # sink slots (`allocate`), tokens held
        self.buffers: QuantizedKV | None = None  # capacity; the first `length` tokens are valid
        self.reserved = 0  # tokens reserved up front (`OscarLayer.reserve`), whole blocks
        self._views: tuple = (None, 0, None)  # (buffers, length, `quantized()` of them)

    def clear(self) -> None:
        """Hold nothing (the reservation stays)."""
        self.exact_keys = self.exact_values = self.buffers = None
        self.held = self.length = self.sinks = self.sinks_held = 0
        self._views = (None, 0, None)

    def empty_quantized(self, layout: StorageLayout) -> None:
        """Hold no quantized tokens, stored in `layout` from now on (bits="auto"); the sinks and the window stay."""
        self.layout, self.buffers, self.length, self._views = layout, None, 0, (None, 0, None)

    def allocate(self, key_states: torch.Tensor, value_states: torch.Tensor, sinks: int = 0) -> None:
        """The exact buffers (`sinks` slots, then the window) for K/V like these, zeroed: compiled steps read unused
        slots (masked), which must never hold NaN garbage."""
        self.sinks = sinks
        tokens = sinks + self.window
        self.exact_keys = key_states.new_zeros(*key_states.shape[:2], tokens, key_states.shape[-1])
        self.exact_values = value_states.new_zeros(*value_states.shape[:2], tokens, value_states.shape[-1])

    # The window: the last R slots of the exact buffers, a view made at each access. A compiled step then sees one
    # input per buffer, the static one, and slices it in its graph; a view held as an attribute would enter the graph
    # as a second input aliasing the first, whose mutation makes CUDA graphs skip the whole step (docs/kernels.md).
    keys = property(lambda self: self._window(self.exact_keys), doc="[B, Hkv, R, D] exact window keys")
    values = property(lambda self: self._window(self.exact_values), doc="[B, Hkv, R, D] exact window values")

    def _window(self, exact: torch.Tensor | None) -> torch.Tensor | None:
        return exact[:, :, self.sinks :] if self.sinks and exact is not None else exact

    def check_batch(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Refuse K/V whose batch, heads or head_dim differ from what is held (a cache reused for another batch),
        naming the fix, rather than failing inside a kernel or concatenating mismatched histories."""
        held = (self.keys.shape[:2], self.keys.shape[-1], self.values.shape[-1])
        if (key_states.shape[:2], key_states.shape[-1], value_states.shape[-1]) == held:
            return
        (batch, heads), _, _ = held
        raise ValueError(
            f"OscarCache holds K/V of batch size {batch} with {heads} KV heads (head dims {held[1]}/{held[2]}), but "
            f"an update brought keys {tuple(key_states.shape)} and values {tuple(value_states.shape)}: a cache "
            "serves one batch of sequences. Call `cache.reset()` before reusing it for another batch, or create a "
            "new OscarCache."
        )

    @property
    def total(self) -> int:
        return self.sinks_held + self.length + self.held

    def set_total(self, total: int) -> None:
        """The lengths of `total` tokens stored by compiled steps (the sinks first, the last 1..R in the window)."""
        self.sinks_held = min(total, self.sinks)
        rest = total - self.sinks_held
        self.length = max(rest - 1, 0) // self.window * self.window
        self.held = rest - self.length

    # ----------------------------------------------------------------------------------------------------------
    # writing
    def append(self, key_states: torch.Tensor, value_states: torch.Tensor, own_sinks: Padding | None = None) -> None:
        """Add tokens to the window, quantizing whole blocks but the newest: the window keeps the last 1..R tokens (a
        complete last block is quantized when the next update begins, `flush`), so a fused decode step finds its own
        tokens in the window. The first positions fill the sinks; with `own_sinks` (`padding.row_sinks`) each row's
        slots take its own first real tokens wherever they arrive (copies that attention and quantization skip)."""
        if own_sinks is not None:
            own_sinks.fill_sinks((self.exact_keys, self.exact_values), (key_states, value_states), self.total)
        if self.sinks_held < self.sinks:
            taken = min(self.sinks - self.sinks_held, key_states.shape[-2])
            end = self.sinks_held + taken
            if own_sinks is None:
                self.exact_keys[:, :, self.sinks_held : end] = key_states[:, :, :taken]
                self.exact_values[:, :, self.sinks_held : end] = value_states[:, :, :taken]
            self.sinks_held = end
            key_states, value_states = key_states[:, :, taken:], value_states[:, :, taken:]
            if not key_states.shape[-2]:
                return
        held, new = self.held, key_states.shape[-2]
        to_quantize = (held + new - 1) // self.window * self.window
        if to_quantize == 0:
            self.keys[:, :, held : held + new] = key_states
            self.values[:, :, held : held + new] = value_states
            self.held += new
            return
        if held:
            key_states = torch.cat([self.keys[:, :, :held], key_states], dim=-2)
            value_states = torch.cat([self.values[:, :, :held], value_states], dim=-2)
        self.grow(self.length + to_quantize)  # once for a long update (a prompt), not a doubling per chunk of it
        for start in range(0, to_quantize, QUANTIZE_CHUNK_TOKENS):
            end = min(start + QUANTIZE_CHUNK_TOKENS, to_quantize)
            self.quantize(key_states[:, :, start:end], value_states[:, :, start:end], self.extend(end - start))
        self.held = key_states.shape[-2] - to_quantize
        self.keys[:, :, : self.held] = key_states[:, :, to_quantize:]
        self.values[:, :, : self.held] = value_states[:, :, to_quantize:]

    def flush(self) -> None:
        """Quantize a complete window before it is read (a decode step's flush)."""
        if self.held == self.window:
            self.quantize(self.keys, self.values, self.extend(self.window))
            self.held = 0

    def extend(self, tokens: int) -> int:
        """The quantized region's next `tokens` rows, for the caller to write: the position of the first."""
        start = self.length
        self.grow(start + tokens)
        self.length = start + tokens
        return start

    def write(self, start: int, block: QuantizedKV, halves: tuple[str, ...] = ("key", "value")) -> None:
        """Write a quantized block at quantized token `start` (block-aligned, inside the quantized region): the fields
        of its `halves` ("key": codes, scales, minimums and token norms; "value")."""
        rows = self.rows(start, start + self.layout.num_tokens(block))
        for name, buf, part in zip(QuantizedKV._fields, rows, block, strict=True):
            if buf is not None and name.split("_")[0] in halves:
                buf.copy_(part)

    def crop(self, keep: int) -> None:
        """Keep the first `keep` tokens. Cropping into the quantized region moves the surviving tokens of the last
        blocks back into the window as the values they decode to, so attention sees exactly what it saw before.
        Cropping into the sinks keeps the first `keep` of them (later tokens fill them again)."""
        if keep <= self.sinks_held:
            self.sinks_held, self.length, self.held = keep, 0, 0
            return
        keep -= self.sinks_held
        if keep >= self.length:
            self.held = keep - self.length
            return
        block_start = keep - keep % self.window
        keys, values = self.dequantize(block_start, self.length)
        survivors = keep - block_start
        self.keys[:, :, :survivors] = keys[:, :, :survivors]
        self.values[:, :, :survivors] = values[:, :, :survivors]
        self.length, self.held = block_start, survivors

    # ----------------------------------------------------------------------------------------------------------
    # reading
    def rows(self, start: int, end: int) -> QuantizedKV:
        """Views of quantized tokens `[start, end)` (block-aligned)."""
        return self.layout.rows(self.buffers, start, end)

    def quantized(self) -> QuantizedKV | None:
        """Views of the quantized region (None: empty), made again only when it grew or moved: the decode steps
        between two flushes read the same views (seven slicing ops less per layer and step)."""
        buffers, length, views = self._views
        if buffers is not self.buffers or length != self.length:
            views = self.rows(0, self.length) if self.length else None
            self._views = (self.buffers, self.length, views)
        return views

    def exact_tokens(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The exact tokens as the kernels read them, the sinks then the window: one run of the exact buffers (the
        window holds tokens only once the sinks are full)."""
        tokens = self.sinks_held + self.held
        return self.exact_keys[:, :, :tokens], self.exact_values[:, :, :tokens]

    def exact(self, new_keys: torch.Tensor, new_values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The exact tokens (`exact_tokens`), then `new_keys`/`new_values`: one new buffer each (`append` may then
        rewrite the window), the size of the sinks, the window and the new tokens, whatever the history holds."""
        keys, values = self.exact_tokens()
        return torch.cat((keys, new_keys), dim=-2), torch.cat((values, new_values), dim=-2)

    def history(
        self,
        new_keys: torch.Tensor | None = None,
        new_values: torch.Tensor | None = None,
        own_sinks: Padding | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Everything stored, then `new_keys`/`new_values` (tokens not stored yet) if given, as dense K/V in the model
        dtype, in position order: the sinks (`own_sinks`: each row's at its positions), the dequantized region, the
        exact window, the new tokens. One new buffer each for K and V, the quantized region dequantized straight into
        it, so that a chunk's dense history is its only transient, and `append` may then rewrite the window freely."""
        window_keys, window_values = self.keys[:, :, : self.held], self.values[:, :, : self.held]
        if new_keys is None:
            new_keys, new_values = window_keys[:, :, :0], window_values[:, :, :0]
        sinks, length, held = self.sinks_held, self.length, self.held
        end = sinks + length
        total = end + held + new_keys.shape[-2]
        keys = window_keys.new_empty(*window_keys.shape[:2], total, window_keys.shape[-1])
        values = window_values.new_empty(*window_values.shape[:2], total, window_values.shape[-1])
        if length:
            self.dequantize(0, length, (keys[:, :, sinks:end], values[:, :, sinks:end]))
        for dense, exact, window, new in (
            (keys, self.exact_keys, window_keys, new_keys),
            (values, self.exact_values, window_values, new_values),
        ):
            dense[:, :, :sinks] = exact[:, :, :sinks]
            dense[:, :, end : end + held] = window
            dense[:, :, end + held :] = new
            if sinks and own_sinks is not None:
                own_sinks.place_sinks(dense, exact[:, :, : self.sinks], end + held)
        return keys, values

    # ----------------------------------------------------------------------------------------------------------
    # capacity
    @property
    def capacity(self) -> int:
        return 0 if self.buffers is None else self.layout.num_tokens(self.buffers)

    def grow(self, tokens: int) -> None:
        """Make room for `tokens` quantized tokens: capacity doubles, so appending is amortized O(block)."""
        capacity = self.capacity
        if tokens <= capacity and self.buffers is not None:
            return
        capacity = -(-max(tokens, 2 * capacity, self.reserved) // self.window) * self.window
        (batch, key_heads, _, key_dim), (_, value_heads, _, value_dim) = self.keys.shape, self.values.shape
        new = self.layout.empty(batch, key_heads, key_dim, value_heads, value_dim, capacity, self.keys.device)
        if self.buffers is not None:
            for buf, old in zip(self.layout.rows(new, 0, self.capacity), self.buffers):
                if buf is not None:
                    buf.copy_(old)
        self.buffers, self._views = new, (None, 0, None)  # views of the old buffers would keep them alive

    def reserve(self, tokens: int) -> None:
        """Allocate capacity for `tokens` quantized tokens (whole blocks) at the next growth, not by doubling."""
        self.reserved = tokens - tokens % self.window

    def allocate_reserved(self) -> None:
        """Storage for the reserved tokens, zero beyond those stored (compiled steps read it, masked)."""
        self.grow(self.reserved)
        for buf, rows in zip(self.buffers, self.layout.tokens_per_row):
            if buf is not None:
                buf[:, :, self.length // rows :] = 0

    def reserved_width(self) -> int:
        """The positions a compiled decode step's kernel may read: the reserved quantized storage, the sinks and the
        window. Its attention mask has this width for the whole generation (generate builds the mask outside the
        compiled forward)."""
        return (self.reserved if self.buffers is None else self.capacity) + self.sinks + self.window

    def apply(self, fn) -> None:
        """Apply a batch-axis (or device) transform to every stored tensor."""
        self.exact_keys, self.exact_values = fn(self.exact_keys), fn(self.exact_values)
        if self.buffers is not None:
            self.buffers = QuantizedKV(*(None if t is None else fn(t) for t in self.buffers))
        self._views = (None, 0, None)
