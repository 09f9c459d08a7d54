"""The Gluon decode kernel's sizes and register, shared-memory and copy layouts (kernels/decode_gluon.py): which lane
holds which code, parameter and MMA fragment; and the index helpers over them."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

D = gl.constexpr(128)  # head dim
ROWS = gl.constexpr(8)  # query rows per KV head: the MMA's N
BLOCK = gl.constexpr(128)  # tokens per step: 8 word rows of 16
HALF = gl.constexpr(64)  # tokens per warp and step

# Two warps per program, one per half of a step's 8 word rows: warp h's tokens are those of rows 4 h .. 4 h + 3; its own
# online softmax over them (a batched MMA: the batch is the warp), its own partial.
MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[2, 1, 1], instr_shape=[1, 16, 8]))
A_OP = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2))
B_OP = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2))

# key words [8 word rows R, 128 channels d]: lane (g, i) of warp h holds row 4 h + g // 2, d = e + 2 i + 8 s + 16 kt
# (lanes g and g + 1 read the same words and keep half g % 2 of each)
K_WORDS = gl.constexpr(
    gl.DistributedLinearLayout(
        [[0, 1], [0, 8], [0, 16], [0, 32], [0, 64]], [[0, 2], [0, 4], [0, 0], [1, 0], [2, 0]], [[4, 0]], [], [8, 128]
    )
)
K_PAIRS = gl.constexpr(  # [8 R, 64 channel pairs c]
    gl.DistributedLinearLayout(
        [[0, 4], [0, 8], [0, 16], [0, 32]], [[0, 1], [0, 2], [0, 0], [1, 0], [2, 0]], [[4, 0]], [], [8, 64]
    )
)
K_CODES = gl.constexpr(  # [R, c, g0, r1, mt]: stored token 16 R + 8 g0 + mt + 4 r1 (g0 = g % 2)
    gl.DistributedLinearLayout(
        [[0, 0, 0, 1, 0], [0, 4, 0, 0, 0], [0, 8, 0, 0, 0], [0, 16, 0, 0, 0], [0, 32, 0, 0, 0], [0, 0, 0, 0, 1],
         [0, 0, 0, 0, 2]],
        [[0, 1, 0, 0, 0], [0, 2, 0, 0, 0], [0, 0, 1, 0, 0], [1, 0, 0, 0, 0], [2, 0, 0, 0, 0]], [[4, 0, 0, 0, 0]], [],
        [8, 64, 2, 2, 4],
    )
)  # fmt: skip
# 4-bit keys: a word row holds 8 tokens (16 word rows a step), so logical row R's two 8-token halves g0 are word rows
# 2 R + g0: lane (g, i) of warp h holds word row 8 h + g (its own words), channels as K_WORDS
K4_WORDS = gl.constexpr(
    gl.DistributedLinearLayout(
        [[0, 1], [0, 8], [0, 16], [0, 32], [0, 64]], [[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]], [[8, 0]], [], [16, 128]
    )
)
# [R, c, g0, r1, s, m]: K_CODES with mt = 2 s + m (token 4 r1 + 2 s + m of word row 2 R + g0)
K4_CODES = gl.constexpr(
    gl.DistributedLinearLayout(
        [[0, 0, 0, 0, 1, 0], [0, 0, 0, 1, 0, 0], [0, 4, 0, 0, 0, 0], [0, 8, 0, 0, 0, 0], [0, 16, 0, 0, 0, 0],
         [0, 32, 0, 0, 0, 0], [0, 0, 0, 0, 0, 1]],
        [[0, 1, 0, 0, 0, 0], [0, 2, 0, 0, 0, 0], [0, 0, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0], [2, 0, 0, 0, 0, 0]],
        [[4, 0, 0, 0, 0, 0]], [], [8, 64, 2, 2, 2, 2],
    )
)  # fmt: skip
# value words of one 32-channel group [8 word rows R, 32 channels]: lane (g, i) of warp h holds row 4 h + i, channel
# g + 8 r1 + 16 mt
V_WORDS = gl.constexpr(
    gl.DistributedLinearLayout([[0, 8], [0, 16]], [[1, 0], [2, 0], [0, 1], [0, 2], [0, 4]], [[4, 0]], [], [8, 32])
)
V_CODES = gl.constexpr(  # [R, ch, s, kt]: stored tokens 16 R + 8 e + kt + 4 s of the word's halves e
    gl.DistributedLinearLayout(
        [[0, 0, 1, 0], [0, 0, 0, 1], [0, 0, 0, 2], [0, 8, 0, 0], [0, 16, 0, 0]],
        [[1, 0, 0, 0], [2, 0, 0, 0], [0, 1, 0, 0], [0, 2, 0, 0], [0, 4, 0, 0]], [[4, 0, 0, 0]], [], [8, 32, 2, 4],
    )
)  # fmt: skip
# 4-bit values: the two halves e of a k-pair are word rows 2 R + e: lane (g, i) of warp h holds word rows 8 h + 2 i + e,
# channels as V_WORDS
V4_WORDS = gl.constexpr(
    gl.DistributedLinearLayout(
        [[1, 0], [0, 8], [0, 16]], [[2, 0], [4, 0], [0, 1], [0, 2], [0, 4]], [[8, 0]], [], [16, 32]
    )
)
V4_CODES = gl.constexpr(  # [R, ch, s, s2, m]: V_CODES with kt = 2 s2 + m (token 4 s + kt of word row 2 R + e)
    gl.DistributedLinearLayout(
        [[0, 0, 0, 1, 0], [0, 0, 1, 0, 0], [0, 8, 0, 0, 0], [0, 16, 0, 0, 0], [0, 0, 0, 0, 1]],
        [[1, 0, 0, 0, 0], [2, 0, 0, 0, 0], [0, 1, 0, 0, 0], [0, 2, 0, 0, 0], [0, 4, 0, 0, 0]], [[4, 0, 0, 0, 0]], [],
        [8, 32, 2, 2, 2],
    )
)  # fmt: skip
# value parameters [2 h, 64 logical tokens x, 4 groups] as the P^T operand holds x (lanes over query rows: broadcast)
V_PARAMS = gl.constexpr(
    gl.DistributedLinearLayout(
        [[0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 8, 0], [0, 16, 0], [0, 32, 0]],
        [[0, 2, 0], [0, 4, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0]], [[1, 0, 0]], [], [2, HALF, 4],
    )
)  # fmt: skip
# key scale/min pairs [4 groups j, 2 rows r, 64 pairs c] of word row 2 j + r (its slice over r: the [4, 64] loaded)
K_PAIRS_BY_GROUP = gl.constexpr(
    gl.DistributedLinearLayout(
        [[0, 0, 4], [0, 0, 8], [0, 0, 16], [0, 0, 32]], [[0, 0, 1], [0, 0, 2], [0, 0, 0], [0, 1, 0], [1, 0, 0]],
        [[2, 0, 0]], [], [4, 2, 64],
    )
)  # fmt: skip
K_GROUP_PAIRS = gl.constexpr(gl.SliceLayout(1, K_PAIRS_BY_GROUP))
# the bias MMA's A operand [2 h, 16, 64 x] as [h, 4 r, 4 groups j, x] (row 4 r + j); its slice over r: the [h, 4, 64]
# loaded
BIAS_BY_GROUP = gl.constexpr(
    gl.DistributedLinearLayout(
        [[0, 0, 0, 1], [0, 2, 0, 0], [0, 0, 0, 8], [0, 0, 0, 16], [0, 0, 0, 32]],
        [[0, 0, 0, 2], [0, 0, 0, 4], [0, 0, 1, 0], [0, 0, 2, 0], [0, 1, 0, 0]], [[1, 0, 0, 0]], [], [2, 4, 4, HALF],
    )
)  # fmt: skip

# Shared memory: two stages (the block being read, the next one arriving) of each tensor, 25.6 KB per program at 2 bits
# (the 4 per SM that the registers allow take 102 KB), 41.6 KB with 4-bit keys and values. The swizzles make the
# fragment loads above conflict-free: key words are read in 8-byte pairs by lanes over 4 word rows (4-bit: 8) and 4
# pairs, value words one by one over 4 word rows and 8 channels (both: 8-word chunks XOR the row; 4-bit values: over
# word rows 2 i + e, XOR the row's pair), key parameters over 4 groups and 4 pairs (4-word chunks XOR the group).
K_WORDS_SMEM = gl.constexpr(gl.SwizzledSharedLayout(8, 1, 8, [1, 0]))  # [stage, 4 key bits word rows, D]
V_WORDS_SMEM = gl.constexpr(gl.SwizzledSharedLayout(8, 1, 8, [1, 0]))  # [stage, 8 word rows, D]
V4_WORDS_SMEM = gl.constexpr(gl.SwizzledSharedLayout(8, 2, 4, [1, 0]))  # [stage, 16 word rows, D]
K_PARAMS_SMEM = gl.constexpr(gl.SwizzledSharedLayout(4, 1, 4, [1, 0]))  # [stage, 4 groups, 64 pairs]
V_PARAMS_SMEM = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0]))  # [stage, 2 h, 64 x, 4 groups]
NORMS_SMEM = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))  # [stage, 2 h, 64 x]
# the copies' layouts over both warps: 16 bytes per lane and copy where the source is contiguous (8 for value
# parameters, 4 for norms)
WORDS_COPY = gl.constexpr(gl.BlockedLayout([1, 4], [1, 32], [2, 1], [1, 0]))  # [8, D]
K_PARAMS_COPY = gl.constexpr(gl.BlockedLayout([1, 4], [2, 16], [2, 1], [1, 0]))  # [4, 64]
V_PARAMS_COPY = gl.constexpr(gl.BlockedLayout([1, 1, 4], [1, 32, 1], [2, 1, 1], [2, 1, 0]))  # [2, 64, 4]
NORMS_COPY = gl.constexpr(gl.BlockedLayout([1, 1], [1, 32], [2, 1], [1, 0]))  # [2, 64]


@gluon.jit
def stored_token(h, x):
    """Warp h's logical token x = g + 8 r1 + 16 mt (MMA row of S^T, k of P^T) -> stored token within the 128-token
    step: position 8 (g % 2) + mt + 4 r1 of word row 4 h + g // 2."""
    g = x % 8
    return 16 * (4 * h + g // 2) + 8 * (g % 2) + x // 16 + 4 * ((x // 8) % 2)


@gluon.jit
def tokens(layout: gl.constexpr):
    """The stored tokens (within the step) of [2 h, 64 x] in `layout`."""
    o_h = gl.arange(0, 2, layout=gl.SliceLayout(1, layout))
    o_x = gl.arange(0, HALF, layout=gl.SliceLayout(0, layout))
    return stored_token(o_h[:, None], o_x[None, :])


@gluon.jit
def column(x):
    """[2 h, 64 x] -> [2, 64, 1] broadcastable over the P^T operand's rows."""
    return gl.convert_layout(x, gl.SliceLayout(2, B_OP), assert_trivial=True)[:, :, None]


@gluon.jit
def expand(x, n: gl.constexpr, LEADING: gl.constexpr):
    """x with n new leading dims (LEADING: x[None, ..., None, ...]) or trailing ones (x[..., None, ..., None])."""
    for _ in gl.static_range(n):
        x = gl.expand_dims(x, 0 if LEADING else x.type.shape.__len__())
    return x
