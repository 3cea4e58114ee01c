"""Compile the linear-attention Triton kernels for an H100 (sm_90) on a machine with no GPU.

``python -m tests.support.sm90_compile`` (TRITON_INTERPRET must be unset: the kernels must be real
JIT functions) compiles every gated delta, short conv and gated norm kernel through Triton's whole
pipeline and ptxas, with the launch options and block sizes the ops use on a GPU at Qwen3.5's head
dims (d_k = d_v = 128), in bf16 and fp32, and prints one JSON object: kernel -> shared memory bytes
(or the compile error). The interpreter accepts code compiled Triton refuses (a loop-carried name
that changes type, returns inside branches) and says nothing about shared memory, so this is the
CPU's only view of both (tests/unit/kernels/test_linear_attention_sm90.py).
"""

from __future__ import annotations

import json
import os

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from xorl_kernels.gated_delta import bwd_triton, fwd_triton
from xorl_kernels.gated_delta import triton_common as tc
from xorl_kernels.gated_delta.op import TRITON_CHUNK_SIZE
from xorl_kernels.rmsnorm import gated_triton
from xorl_kernels.short_conv import triton_kernels as conv

H100 = GPUTarget("cuda", 90, 32)
SHARED_LIMIT = 227 * 1024  # an H100's (and H200's) dynamic shared memory per block
INTS = {"heads_v", "group", "dim", "num_chunks", "n_rows", "n_cols", "rows_per_program"}
FLOATS = {"scale", "eps"}


def compile_shared(fn, pointers: dict, constexprs: dict, **options) -> int:
    """Shared memory bytes of ``fn`` compiled for sm_90; ``pointers`` names every pointer argument's type."""
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = pointers[name]
        else:
            signature[name] = "i32" if name in INTS else "fp32"
            assert name in INTS | FLOATS, f"{fn.__name__}: give {name}'s type"
    consts = {(fn.arg_names.index(k),): v for k, v in constexprs.items()}
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=consts), target=H100, options=options)
    return kernel.metadata.shared


def kernels(dtype: str):
    """(name, kernel, pointer types, constexprs, launch options) as the ops launch them."""
    x, f32, i32 = f"*{dtype}", "*fp32", "*i32"
    prec = "ieee" if dtype == "fp32" else "tf32"
    sizes = dict(fwd_triton.block_sizes(128, 128, TRITON_CHUNK_SIZE), L2NORM=True, DOT_PREC=prec)
    chunk = dict(CH_START=i32, CH_END=i32)
    yield ("wy", fwd_triton._wy_kernel, dict(K=x, V=x, G=f32, BETA=x, GC=f32, U=f32, W=f32, TM=f32, **chunk),
           dict(sizes, STORE_T=True), tc.LAUNCH)
    yield ("state", fwd_triton._state_kernel, dict(K=x, W=f32, U=f32, GC=f32, H=x, VN=f32, INIT=f32, FINAL=f32,
                                                     DOC_OFF=i32, **chunk), dict(sizes, HAS_INIT=True), tc.LAUNCH)
    yield ("output", fwd_triton._output_kernel, dict(Q=x, K=x, GC=f32, H=x, VN=f32, O=x, **chunk), sizes, tc.LAUNCH)
    yield ("delta_grad_local", bwd_triton._delta_grad_local_kernel, dict(Q=x, K=x, GC=f32, DO=x, DVN=f32, **chunk),
           sizes, tc.LAUNCH)
    yield ("state_grad", bwd_triton._state_grad_kernel,
           dict(Q=x, K=x, GC=f32, W=f32, DO=x, DVN=f32, DH=x, DFINAL=f32, DINIT=f32, DOC_OFF=i32, **chunk),
           dict(sizes, HAS_DFINAL=True), tc.LAUNCH)
    yield ("qk_grad", bwd_triton._qk_grad_kernel,
           dict(Q=x, K=x, GC=f32, H=x, DH=x, VN=f32, DVN=f32, DO=x, DQ=f32, DK_PART=f32, DG_PART=f32, DW=f32, **chunk),
           sizes, tc.LAUNCH)
    yield ("wy_grad", bwd_triton._wy_grad_kernel,
           dict(K=x, V=x, BETA=x, GC=f32, TM=f32, DVN=f32, DW=f32, DK_PART=f32, DG_PART=f32, DK_OUT=f32, DV_OUT=x,
                DG_OUT=f32, DB_OUT=f32, **chunk), sizes, tc.LAUNCH)
    tables = dict(CH_START=i32, CH_END=i32, CH_DOC=i32, CU=i32)
    blocks = dict(W=4, HAS_INIT=True, BT=conv.token_block(), BD=conv._channel_block(4096))
    yield ("conv_fwd", conv._fwd_kernel, dict(X=x, WT=f32, BIAS=f32, INIT=x, Y=x, **tables),
           dict(blocks, SILU=True, HAS_BIAS=True), {})
    yield ("conv_dz", conv._dz_kernel, dict(X=x, WT=f32, BIAS=f32, INIT=x, DY=x, DZ=f32, DW_PART=f32, **tables),
           dict(blocks, WP=4, SILU=True, HAS_BIAS=True), {})
    yield ("conv_dx", conv._dx_kernel, dict(WT=f32, DZ=f32, DX=x, DINIT=x, **tables), blocks, {})
    normed = {"bf16": tl.bfloat16, "fp16": tl.float16}.get(dtype, tl.float32)
    yield ("gated_norm_fwd", gated_triton._fwd_kernel, dict(x_ptr=x, z_ptr=x, w_ptr=x, y_ptr=x, rstd_ptr=f32),
           dict(NORMED_TY=normed, BLOCK=128), {})
    yield ("gated_norm_bwd", gated_triton._bwd_kernel,
           dict(dy_ptr=x, x_ptr=x, z_ptr=x, w_ptr=x, rstd_ptr=f32, dx_ptr=x, dz_ptr=x, dw_part_ptr=f32),
           dict(BLOCK=128), {})


def main() -> None:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("unset TRITON_INTERPRET: the kernels must be compiled, not interpreted")
    report = {}
    for dtype in ("bf16", "fp32"):
        for name, fn, pointers, constexprs, options in kernels(dtype):
            try:
                report[f"{name}:{dtype}"] = compile_shared(fn, pointers, constexprs, **options)
            except Exception as exc:  # noqa: BLE001 - reported, the test names the kernel
                report[f"{name}:{dtype}"] = f"{type(exc).__name__}: {str(exc)[:400]}"
    print(json.dumps(report))


if __name__ == "__main__":
    main()
