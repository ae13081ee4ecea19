#!/usr/bin/env bash
# Start the pinned llama.cpp's CUDA build (llama-bench, or the exported LLAMA_TARGETS, sm_90) in the
# background on the device,
# from .device/llama-src.tar.xz (the trimmed vendored tree of llama-cpp-python 0.3.36);
# /tmp/llama/build.rc holds its exit status when done (~6 minutes on 16 cores).
cd "$(dirname "$0")/../.."
[ -d /tmp/llama/llama.cpp ] && { echo "llama.cpp's build already started on this machine"; exit 0; }
mkdir -p /tmp/llama && tar xJf .device/llama-src.tar.xz -C /tmp/llama || exit 1
setsid bash -c 'cd /tmp/llama/llama.cpp && cmake -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
  -DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
  -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release > /tmp/llama/build.log 2>&1 \
  && cmake --build build --target ${LLAMA_TARGETS:-llama-bench} -j 12 >> /tmp/llama/build.log 2>&1; echo $? > /tmp/llama/build.rc' \
  > /dev/null 2>&1 < /dev/null &
