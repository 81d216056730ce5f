#!/bin/bash
# Issue 42's checks on a GPU machine, in one call of the device tool (not a test). A task is lent a GPU for 15
# minutes in all, starts and the CUDA build included (docs/results.md, "A GPU": a start of minutes, the build
# 200 s), so the checks run in one call, each under its own time limit, and what each printed goes to $OUT:
#
#   bash tests/perf/gpu_pack.sh /tmp/smol4.gguf                      # here: .gpu/ (the 4-layer cut travels)
#   run: bash tests/perf/gpu_device.sh bash tests/perf/gpu_check.sh   # there, carry [".gpu"], timeout_s 580
#
# 1. greedy: every strategy's text is `ar`'s on CUDA (near-ties aside: the bench marks them);
# 2. alone: `auto` against `ar` one answer at a time, as the chat app and `specchat run` run it, with an `ar`
#    control (its ratio is the machine's noise);
# 3. matrix: the in-process cells at 1 and 8 clients, greedy and 0.8, the target as its own draft (what can
#    travel), each run at least --seconds long, recorded to $OUT/matrix.jsonl (append it to docs/matrix.jsonl).
#
# Dry run on a CPU, smaller: NGL=0 PYTHON=.venv/bin/python QUICK=1 MODEL=/tmp/smol4.gguf bash tests/perf/gpu_check.sh
set -uo pipefail
py=${PYTHON:-python3}
model=${MODEL:-.gpu/model.gguf}
ngl=${NGL:-99}
out=${OUT:-/tmp/gpu-check}
mkdir -p "$out"
if [ -n "${QUICK:-}" ]; then repeats=1; n=16; seconds=0; clients=1; else repeats=3; n=96; seconds=5; clients=1,8; fi
offload=(-ngl "$ngl" -ngld "$ngl")

step() {  # step NAME SECONDS COMMAND...: its output in $OUT/NAME.log, its exit status and its last lines here
  local name=$1 limit=$2
  shift 2
  echo "== $name ($(date +%T), at most ${limit}s)"
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  echo "   exit $?"
  tail -n 14 "$out/$name.log"
}

command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
step greedy 100 "$py" -m app bench -m "$model" -md "$model" -s ar,sps,lookup,lookahead,tree,suffix,auto \
  --prompts chat --limit 2 -n 32 --temp 0 -t 2 --repeats 1 --no-memory "${offload[@]}" --out "$out/greedy"
step alone 130 "$py" -m app bench -m "$model" -md "$model" -s ar,auto --control --prompts chat --limit 4 -n "$n" \
  --temp 0.8 --seed 1 -t 2 --repeats "$repeats" --no-memory "${offload[@]}" --out "$out/alone"
step matrix 320 "$py" tests/perf/machine_matrix.py --target "$model" -ngl "$ngl" --threads 2 --hog off --drafts f32 \
  --clients "$clients" --temps 0,0.8 --modes inproc --repeats "$repeats" --control --seconds "$seconds" \
  --record "$out/matrix.jsonl" --out "$out/matrix.md"
