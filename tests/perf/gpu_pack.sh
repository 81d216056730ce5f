#!/bin/bash
# Pack what a GPU machine of the workplace's device tool needs into .gpu/ (ignored by git; not a test).
#
# That machine is bare and reaches no package index, and a call carries at most 64 MiB of the working tree
# (docs/results.md, "A GPU"). So this packs llama-cpp-python's sdist without what its build does not use
# (~4 MB), the wheels specchat needs that the machine's Python lacks, llguidance as installed here, a model
# small enough to travel (tests/perf/cut_layers.py makes one), and, for an A/B, the product's code at BASE.
# tests/perf/gpu_device.sh then builds llama.cpp for CUDA there (about 200 s on 16 cores) and runs a command:
#
#   bash tests/perf/gpu_pack.sh /tmp/smol4.gguf 302691d       # here
#   run: bash tests/perf/gpu_device.sh python3 -m app bench -m .gpu/model.gguf -md .gpu/model.gguf -s ar,auto \
#        --prompts chat --clients 1,8 -ngl 99 -ngld 99           # there, carry [".gpu"]
set -euo pipefail
model=${1:?a GGUF small enough to travel (tests/perf/cut_layers.py)}; base=${2:-}
root=$(git rev-parse --show-toplevel); cd "$root"
py=${PYTHON:-$root/.venv/bin/python}
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
rm -rf .gpu && mkdir -p .gpu/whl
work=$(mktemp -d)
"$py" -m pip download -q --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d "$work"
tar xzf "$work"/llama_cpp_python-0.3.36.tar.gz -C "$work" && mv "$work"/llama_cpp_python-0.3.36 "$work"/strip
(cd "$work"/strip && rm -rf .git vendor/llama.cpp/{docs,models,tests,examples,benches,media,conversion,gguf-py,scripts,pocs,tools,app,.github})
(cd "$work"/strip/vendor/llama.cpp/ggml/src && for d in ggml-*/; do
   case $d in ggml-cpu/|ggml-cuda/|ggml-rpc/|ggml-blas/) ;; *) rm -rf "$d" ;; esac; done)
tar czf .gpu/llsrc.tgz -C "$work" strip
# specchat's own needs, at the versions installed here, that the machine's Python (PyTorch's image) lacks
pkgs=$("$py" -m pip list --format=freeze 2>/dev/null | grep -i -E '^(textual|gguf|platformdirs|starlette|uvicorn|httptools|diskcache|huggingface.hub|hf.xet|httpx2|httpcore2|truststore|rich|markdown.it.py|mdit.py.plugins|linkify.it.py|uc.micro.py)==')
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 -d .gpu/whl $pkgs
site=$("$py" -c 'import llguidance, os; print(os.path.dirname(os.path.dirname(llguidance.__file__)))')
cp -r "$site"/llguidance "$site"/llguidance-*.dist-info .gpu/
cp "$model" .gpu/model.gguf
if [ -n "$base" ]; then mkdir -p .gpu/old && git archive "$base" app backends models tests/perf | tar x -C .gpu/old; fi
rm -rf "$work"
size=$(( $(du -sb .gpu | cut -f1) + $(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1) ))
echo ".gpu packed: $(( size / 1048576 )) MiB with the tracked tree (a call carries 64)"
[ "$size" -lt 67108864 ] || { echo "too big to travel: cut the model (tests/perf/cut_layers.py)" >&2; exit 1; }
