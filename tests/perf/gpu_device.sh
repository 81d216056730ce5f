#!/bin/bash
# On a GPU machine of the device tool, with .gpu/ carried (tests/perf/gpu_pack.sh): llama-cpp-python built for
# CUDA into /tmp/site (kept while the machine stays warm; a build under way goes on where it stopped), then the
# command given, with the environment specchat needs there (not a test).
#
# LD_PRELOAD: in that machine's image, importing its numpy before llama.cpp loads a model made the tokenizer
# crash in std::regex (docs/results.md, "A GPU"); the system's libstdc++ loaded first cures it.
set -uo pipefail
mkdir -p /tmp/work /tmp/site
if ! PYTHONPATH=/tmp/site python3 -c "import llama_cpp" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl
  cp -r .gpu/llguidance .gpu/llguidance-*.dist-info /tmp/site/
  [ -d /tmp/work/strip ] || tar xzf .gpu/llsrc.tgz -C /tmp/work
  (cd /tmp/work/strip && CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
   CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCH:-90} -DLLAVA_BUILD=off -DGGML_CUDA_FA=off -DGGML_CUDA_NCCL=off -DGGML_RPC=on" \
   timeout "${BUILD_LIMIT:-400}" python3 -m pip install -q --no-build-isolation --no-deps --no-cache-dir --upgrade \
     --target /tmp/site -Cbuild-dir=/tmp/work/build . > /tmp/work/build.log 2>&1) || { tail -20 /tmp/work/build.log; exit 1; }
fi
export LD_PRELOAD=/lib/x86_64-linux-gnu/libstdc++.so.6 PYTHONPATH=/tmp/site SPECCHAT_DATA_DIR=/tmp/work/data PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
"$@"
