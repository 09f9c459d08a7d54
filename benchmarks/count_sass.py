"""Instructions per dequantized code of the fused decode kernel's inner loop, counted on the CPU (no GPU needed).

    python benchmarks/count_sass.py [--block-n N] [--warps W] [--gqa 4] [--head-dim 128] [--arch 90]

Compiles `_split_kernel` for an NVIDIA target with this machine's Triton (its bundled ptxas), disassembles it with
the bundled nvdisasm and reads the quantized tokens' main loop (the longest loop of the kernel: full blocks), with the
launch's step and warps unless given. It reports `warps * 32 * loop instructions / (block_n * 2 * head_dim)`
lane-instructions per K or V code, and the registers and spills, which bound the programs per SM. The kernel is
latency-bound (benchmarks/NOTES_kernels.md): fewer instructions help only with fewer registers or fewer waits, so
time the winner on a GPU. Counts depend on the Triton version (the GPU image may run another).
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import tempfile
from pathlib import Path

import torch
import triton
from oscar_hf.kernels.decode_attention import _default_tuning, _split_kernel
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

_BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
_POINTERS = {  # bf16 model, 2-bit codes, fp16 scales, fp32 norms and partials
    "q_ptr": "*bf16", "kc_ptr": "*i32", "ks_ptr": "*fp16", "km_ptr": "*fp16", "kn_ptr": "*fp32", "vc_ptr": "*i32",
    "vs_ptr": "*fp16", "vm_ptr": "*fp16", "rk_ptr": "*bf16", "rv_ptr": "*bf16", "mask_ptr": "*i8",
    "key_rotated_ptr": "*i8", "part_o_ptr": "*fp32", "part_ml_ptr": "*fp32",
}  # fmt: skip


def compile_split_kernel(
    block_n: int, warps: int, gqa: int, head_dim: int, arch: int, per_head: bool = False, stages: int = 3,
    residual_block: int = 32,
):  # fmt: skip
    constants = dict(
        GQA=gqa, TQ=1, HEAD_DIM=head_dim, LOG2_D=head_dim.bit_length() - 1, BITS=2, GROUP=32,
        BLOCK_M=max(16, triton.next_power_of_2(gqa)), BLOCK_N=block_n, BLOCK_R=residual_block, ROTATION=True,
        KEY_ROTATION_PER_HEAD=per_head, TOKEN_SCALING=True, HAS_MASK=False, PARTIAL_BLOCK=False,
    )  # fmt: skip
    signature = {
        name: "constexpr" if name in constants else _POINTERS.get(name, "fp32" if name == "qk_scale" else "i32")
        for name in _split_kernel.arg_names
    }
    source = ASTSource(fn=_split_kernel, signature=signature, constexprs=constants)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=warps, num_stages=stages))


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--block-n", type=int, help="tokens per step (default: the launch's)")
    parser.add_argument("--warps", type=int, help="warps per program (default: the launch's)")
    parser.add_argument("--gqa", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--arch", type=int, default=90, help="sm_XX target")
    parser.add_argument("--per-head", action="store_true", help='method="oscar": key rotation chosen per KV head')
    args = parser.parse_args()
    launch = _default_tuning(args.head_dim, args.gqa, torch.float16)
    args.block_n, args.warps = args.block_n or launch.block_n, args.warps or launch.num_warps

    kernel = compile_split_kernel(
        args.block_n, args.warps, args.gqa, args.head_dim, args.arch, args.per_head,
        launch.num_stages, launch.residual_block,
    )  # fmt: skip
    instructions, labels, usage = disassemble(kernel)
    loops = []  # (start, end) of every backward branch
    for address, text in instructions:
        target = re.search(r"BRA\s+`\((\.L_x_\d+)\)", text)
        if target and labels.get(target.group(1), address + 1) <= address:
            loops.append((labels[target.group(1)], address))
    start, end = max(loops, key=lambda loop: loop[1] - loop[0])  # the full quantized blocks: the longest loop
    body = [text for address, text in instructions if start <= address <= end]
    opcodes = collections.Counter(re.sub(r"^@!?U?P[T\d]+\s+", "", text).split()[0].split(".")[0] for text in body)
    per_code = args.warps * 32 * len(body) / (args.block_n * 2 * args.head_dim)
    print(f"triton {triton.__version__}, sm_{args.arch}, {usage}, dynamic shared {kernel.metadata.shared} B")
    print(
        f"block_n={args.block_n} warps={args.warps} gqa={args.gqa} D={args.head_dim}: {len(body)} instructions per "
        f"step and warp = {per_code:.2f} per K or V code"
    )
    print("most frequent:", ", ".join(f"{op} {n}" for op, n in opcodes.most_common(16)))


if __name__ == "__main__":
    main()
