"""Instructions per dequantized code of the fused decode kernel's inner loop, counted on the CPU (no GPU needed).

    python benchmarks/count_sass.py [--block-n N] [--warps W] [--gqa 4] [--head-dim 128] [--arch 90] [--gluon]

Compiles `_split_kernel` (with `--gluon`: the Gluon kernel that reads the full 128-token blocks at D=128, its launch
forced as on a GPU) for an NVIDIA target with this machine's Triton (its bundled ptxas) from the arguments the
launcher passes (so strides and alignments are specialized as on the GPU), disassembles it with the bundled nvdisasm
and reads the quantized tokens' main loop (the longest loop of the kernel: full blocks), with the launch's step and
warps unless given. It reports `warps * 32 * loop instructions / (block_n * 2 * head_dim)` lane-instructions per K or
V code, the registers and spills, which bound the programs per SM, and the loop's global loads that Triton did not
pipeline (`LDG`: every step waits for them; cp.async copies, `LDGSTS`, arrive steps ahead, as all of the Gluon
kernel's do). The kernels are bound by their instructions and latency (docs/kernels.md): fewer
instructions help only with no more registers or waits, so time the winner on a GPU. Counts depend on the Triton
version (the GPU image may run another).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import re
import subprocess
import tempfile
from pathlib import Path
from unittest import mock

import torch
import triton
from oscar_hf.kernels import decode_attention, decode_gluon, decode_paged
from oscar_hf.kernels.decode_tuning import default_tuning
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler.compiler import make_backend
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import create_function_from_signature

from oscar_hf.config import OscarConfig
from oscar_hf.layout import SUPPORTED_WIDTHS, StorageLayout
from oscar_hf.serving.pages import PageLayout, TailLayout, round_up

_BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def _paged_launch_arguments(tuning, gqa: int, head_dim: int, key_bits: int, value_bits: int) -> dict:
    """The arguments `paged_decode_attention` passes the Gluon kernel (its launch forced, as on a GPU) for a decode
    step of the serving pool: B=16, Hkv=8, 80 pages of 128 tokens each, one page per layer of a 32-layer block (the
    pool's strides), on CPU tensors as `_launch_arguments`'."""
    batch, kv_heads, pages_each, layers = 16, 8, 80, 32
    config = OscarConfig(method="paper", key_bits=key_bits, value_bits=value_bits, sink_tokens=4)
    page = PageLayout.of(config, kv_heads, head_dim)
    block_bytes = round_up(layers * page.bytes, 512)
    blocks = batch * pages_each
    pages = page.views(torch.empty(blocks * block_bytes, dtype=torch.uint8), block_bytes, layers - 1)
    tail = TailLayout(layers, config.sink_tokens, config.residual_length, kv_heads, head_dim, torch.bfloat16)
    tail_bytes = round_up(tail.bytes, 512)
    tail_keys, tail_values = tail.views(torch.empty(batch * tail_bytes, dtype=torch.uint8), tail_bytes, layers - 1)
    table = torch.randperm(blocks, dtype=torch.int32).view(batch, pages_each)
    counts = torch.full((batch,), pages_each, dtype=torch.int32)
    query = torch.randn(batch, kv_heads * gqa, 1, head_dim, dtype=torch.bfloat16)
    recorded = {}
    gluon_kernel = decode_gluon._gluon_split_kernel
    with _recording(decode_paged, "paged_split_kernel", (4, ""), recorded):
        decode_paged.paged_decode_attention(
            query, pages, tail_keys, tail_values, table, counts, torch.arange(batch, dtype=torch.int32),
            torch.full((batch,), 70, dtype=torch.int32), head_dim**-0.5, config, tuning=tuning,
        )  # fmt: skip
    return gluon_kernel, recorded[gluon_kernel]


@contextlib.contextmanager
def _recording(launcher, split_kernel: str, gluon_splits: tuple[int, str], recorded: dict):
    """`launcher`'s Triton kernels (`split_kernel` and the merge) and the Gluon kernel swapped for recorders
    (`_recorder`), and the Gluon kernel's split count fixed at `gluon_splits` (0: not run)."""
    with (
        mock.patch.object(launcher, split_kernel, _recorder(getattr(launcher, split_kernel), recorded)),
        mock.patch.object(launcher, "merge_kernel", _recorder(launcher.merge_kernel, recorded)),
        mock.patch.object(decode_gluon, "_gluon_split_kernel", _recorder(decode_gluon._gluon_split_kernel, recorded)),
        mock.patch.object(launcher, "gluon_splits_for", lambda *args: gluon_splits),
    ):
        yield


def _recorder(kernel, recorded: dict):
    """A stand-in for `kernel` whose `[grid](...)` records the arguments by name in `recorded[kernel]`."""

    def launch(*args, **kwargs):
        recorded[kernel] = dict(zip(kernel.arg_names, args)) | kwargs

    return mock.Mock(__getitem__=lambda self, grid: launch, arg_names=kernel.arg_names, fn=kernel.fn)


def _launch_arguments(
    tuning, gqa: int, head_dim: int, per_head: bool, masked: bool, gluon=False, key_bits=2, value_bits=2
) -> dict:
    """The arguments `decode_attention_triton` passes a kernel for a bf16 model's decode step (B=8, Hkv=8, 32K
    quantized tokens, residual window 64), by name: the Triton split kernel's, or with `gluon` the Gluon kernel's (its
    launch forced, as on a GPU). Built on CPU tensors of the storage layout: the same strides and alignments the GPU
    launch specializes on (a stride of 1 becomes a constant, multiples of 16 are marked divisible), so the compiled
    loop is the launched one. The kernels are swapped for a recorder, the CPU tensors let through."""
    context = 32768
    batch, kv_heads, residual = 8, 8, 64
    config = OscarConfig(method="oscar" if per_head else "paper", key_bits=key_bits, value_bits=value_bits)
    query = torch.randn(batch, kv_heads * gqa, 1, head_dim, dtype=torch.bfloat16)
    quantized = StorageLayout.of(config).empty(batch, kv_heads, head_dim, kv_heads, head_dim, context, "cpu")
    keys, values = (torch.randn(batch, kv_heads, residual, head_dim, dtype=torch.bfloat16) for _ in range(2))
    mask = torch.ones(batch, context + residual, dtype=torch.bool) if masked else None
    key_rotated = torch.ones(batch, kv_heads, dtype=torch.bool) if per_head else None
    recorded = {}
    gluon_kernel = decode_gluon._gluon_split_kernel
    with (
        _recording(decode_attention, "split_kernel", (16, "") if gluon else (0, "not asked"), recorded),
        mock.patch.object(decode_attention, "interpreting", lambda: True),
        mock.patch.object(decode_attention, "_PLANS", {}),  # plans made with these stand-ins are not kept
    ):
        decode_attention.decode_attention_triton(
            query, quantized, keys, values, mask, head_dim**-0.5, config, key_rotated, tuning=tuning
        )
    kernel = gluon_kernel if gluon else decode_attention.split_kernel
    return kernel, recorded[kernel]


def compile_kernel(
    tuning, gqa: int, head_dim: int, arch: int, per_head=False, masked=False, gluon=False, key_bits=2, value_bits=2,
    paged=False,
):  # fmt: skip
    """The split kernel (or with `gluon` the Gluon kernel, with `paged` the Gluon kernel over the serving pool's pages)
    compiled for sm_`arch` with the launch's arguments, specialized as Triton's launcher does."""
    if paged:
        kernel, arguments = _paged_launch_arguments(tuning, gqa, head_dim, key_bits, value_bits)
        gluon = True
    else:
        kernel, arguments = _launch_arguments(
            tuning, gqa, head_dim, per_head, masked, gluon=gluon, key_bits=key_bits, value_bits=value_bits
        )
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(**arguments)
    options, signature, constexprs, attrs = kernel._pack_args(backend, arguments, bound, specialization, options)
    source = (GluonASTSource if gluon else ASTSource)(kernel, signature, constexprs, attrs)
    return triton.compile(source, target=target, options=options.__dict__)


def disassemble(kernel) -> tuple[list[tuple[int, str]], dict[str, int], str]:
    """(address, instruction) pairs, label addresses, and cuobjdump's resource usage line."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        text = subprocess.run([_BIN / "nvdisasm", "-c", cubin.name], capture_output=True, text=True, check=True)
        usage = subprocess.run([_BIN / "cuobjdump", "-res-usage", cubin.name], capture_output=True, text=True)
    instructions, labels, pending = [], {}, []
    for line in text.stdout.splitlines():
        if label := re.match(r"\s*(\.L_x_\d+):", line):
            pending.append(label.group(1))
        elif ins := re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line):
            address = int(ins.group(1), 16)
            labels.update(dict.fromkeys(pending, address))
            pending = []
            instructions.append((address, ins.group(2).strip()))
    return instructions, labels, re.search(r"REG:\d+.*", usage.stdout).group(0)


def loop_report(kernel) -> tuple[list[str], collections.Counter, str]:
    """The longest loop's instructions (a kernel's main loop), their opcode counts, and the resource usage line."""
    instructions, labels, usage = disassemble(kernel)
    loops = []  # (start, end) of every backward branch
    for address, text in instructions:
        target = re.search(r"BRA\s+`\((\.L_x_\d+)\)", text)
        if target and labels.get(target.group(1), address + 1) <= address:
            loops.append((labels[target.group(1)], address))
    start, end = max(loops, key=lambda loop: loop[1] - loop[0])
    body = [text for address, text in instructions if start <= address <= end]
    opcodes = collections.Counter(re.sub(r"^@!?U?P[T\d]+\s+", "", text).split()[0].split(".")[0] for text in body)
    return body, opcodes, usage


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--block-n", type=int, help="tokens per step (default: the launch's)")
    parser.add_argument("--warps", type=int, help="warps per program (default: the launch's)")
    parser.add_argument("--gqa", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--arch", type=int, default=90, help="sm_XX target")
    parser.add_argument("--per-head", action="store_true", help='method="oscar": key rotation chosen per KV head')
    parser.add_argument("--masked", action="store_true", help="with a key padding mask (a left-padded batch)")
    parser.add_argument("--gluon", action="store_true", help="the Gluon kernel's loop (128-token steps, two warps)")
    parser.add_argument("--paged", action="store_true", help="the Gluon kernel over the serving pool's pages")
    parser.add_argument("--key-bits", type=int, default=2, choices=SUPPORTED_WIDTHS)
    parser.add_argument("--value-bits", type=int, default=2, choices=SUPPORTED_WIDTHS)
    args = parser.parse_args()
    launch = default_tuning(args.head_dim, args.gqa, torch.float16)
    launch = dataclasses.replace(
        launch, block_n=args.block_n or launch.block_n, num_warps=args.warps or launch.num_warps
    )
    args.block_n, args.warps = launch.block_n, launch.num_warps
    if args.gluon or args.paged:
        args.block_n, args.warps = decode_gluon.BLOCK.value, decode_gluon.WARPS

    kernel = compile_kernel(
        launch, args.gqa, args.head_dim, args.arch, per_head=args.per_head, masked=args.masked, gluon=args.gluon,
        key_bits=args.key_bits, value_bits=args.value_bits, paged=args.paged,
    )  # fmt: skip
    body, opcodes, usage = loop_report(kernel)
    per_code = args.warps * 32 * len(body) / (args.block_n * 2 * args.head_dim)
    print(f"triton {triton.__version__}, sm_{args.arch}, {usage}, dynamic shared {kernel.metadata.shared} B")
    print(
        f"block_n={args.block_n} warps={args.warps} gqa={args.gqa} D={args.head_dim}: {len(body)} instructions per "
        f"step and warp = {per_code:.2f} per K or V code"
    )
    print(f"global loads waited on in the loop (LDG, not pipelined): {opcodes['LDG']}")
    print("most frequent:", ", ".join(f"{op} {n}" for op, n in opcodes.most_common(16)))


if __name__ == "__main__":
    main()
