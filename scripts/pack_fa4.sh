#!/usr/bin/env bash
# Build .whl/fa4/fa4site.tar.xz: flash-attn 4 and its runtime, unpacked for CPython 3.12 / CUDA 13 and
# pruned to fit the GPU machine's 64 MiB carry (the GPU image has torch, cuda-bindings and einops).
# Run here (needs PyPI); gpu_check.sh unpacks it there.
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d); site="$work/site"; mkdir -p "$site" .whl/fa4
plat="--platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64"
for pkg in flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 \
           nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 \
           apache-tvm-ffi==0.1.15.post2 quack-kernels==0.6.5; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $plat -d "$work/wheels" "$pkg"
done
for w in "$work"/wheels/*.whl; do python3 -m zipfile -e "$w" "$site"; done
# not needed to run the forward kernels: profilers, C++ sources and headers, stubs, benchmarks,
# quack's GEMM/epilogue families (flash_attn.cute imports none of them)
rm -rf "$site"/nvidia_cutlass_dsl/dsl_packages/iket "$site"/nvidia_cutlass_dsl/cu13/include \
       "$site"/nvidia_cutlass_dsl/cu13/lib/*.a "$site"/nvidia_cutlass_dsl/cu13/lib/stubs \
       "$site"/tvm_ffi/src "$site"/tvm_ffi/3rdparty "$site"/tvm_ffi/include "$site"/tvm_ffi/cython \
       "$site"/tvm_ffi/lib/libtvm_ffi_testing.so "$site"/flash_attn/cute/benchmark*.py
find "$site" -name '*.pyi' -delete
(cd "$site/quack" && rm -rf activation.py autotuner.py bench blockscaled broadcast_utils.py cache/_pool_preload.py \
  complex.py distributed dsl/smem_struct.py epilogue fast_math.py gemm*.py jax_utils.py linear*.py mlp.py \
  nvmmh_heuristic.py operand_transform pipeline_checks.py rms_final_reduce.py rotary.py sm100_utils.py \
  sm80_utils.py softmax_jax.py sort spec split_k_reduce.py sync tensormap_manager.py)
tar -C "$site" -cf - . | xz -T2 -9e > .whl/fa4/fa4site.tar.xz
rm -rf "$work"
ls -la .whl/fa4/fa4site.tar.xz
