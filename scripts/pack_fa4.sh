#!/usr/bin/env bash
# Build flash-attn 4 and its runtime, unpacked for CPython 3.12 / CUDA 13 and pruned (the GPU image has
# torch, cuda-bindings and einops), as one fa4site.tar.xz split in two: .whl/fa4a/ and .whl/fa4b/. The
# whole is a little over the GPU machine's 64 MiB carry, so carry .whl/fa4a in one call and .whl/fa4b in
# the next while the machine is warm; gpu_check.sh joins and unpacks them. Run here (needs PyPI).
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d); site="$work/site"; mkdir -p "$site"
plat="--platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64"
for pkg in flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 \
           nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 \
           apache-tvm-ffi==0.1.15.post2 quack-kernels==0.6.5; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $plat -d "$work/wheels" "$pkg"
done
for w in "$work"/wheels/*.whl; do python3 -m zipfile -e "$w" "$site"; done
# not needed to run the forward kernels: profilers, C++ sources and headers, stubs, benchmarks. Kept on
# purpose: tvm_ffi's libtvm_ffi_testing.so (its core module links it) and all of quack (flash_attn.cute
# imports quack, whose __init__ imports rmsnorm, the autotuner and more): pruning either made
# `import flash_attn.cute` fail on the GPU machine.
rm -rf "$site"/nvidia_cutlass_dsl/dsl_packages/iket "$site"/nvidia_cutlass_dsl/cu13/include \
       "$site"/nvidia_cutlass_dsl/cu13/lib/*.a "$site"/nvidia_cutlass_dsl/cu13/lib/stubs \
       "$site"/tvm_ffi/src "$site"/tvm_ffi/3rdparty "$site"/tvm_ffi/include "$site"/tvm_ffi/cython \
       "$site"/flash_attn/cute/benchmark*.py
find "$site" -name '*.pyi' -delete
tar -C "$site" -cf - . | xz -T2 -9e > "$work/fa4site.tar.xz"
rm -rf .whl/fa4 .whl/fa4a .whl/fa4b; mkdir -p .whl/fa4a .whl/fa4b
split -b 36000000 "$work/fa4site.tar.xz" "$work/fa4site.tar.xz.part-"
mv "$work/fa4site.tar.xz.part-aa" .whl/fa4a/ && mv "$work/fa4site.tar.xz.part-ab" .whl/fa4b/
rm -rf "$work"
ls -la .whl/fa4a .whl/fa4b
