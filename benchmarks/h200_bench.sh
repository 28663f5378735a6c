#!/usr/bin/env bash
# The GPU measurements of the README's Benchmarks section, on the offline GPU machine, as calls of under
# 10 minutes each (after `source .gpu/prelude.sh`, see ../shared/gpu/README.md), in this order:
#   bash benchmarks/h200_bench.sh tests        the GPU-only tests (CUDA graphs, draft models and EAGLE-3 heads, the compiled unroll)
#   bash benchmarks/h200_bench.sh train        distillation tokens/s by trainer setting (benchmarks/profile_train.py)
#   bash benchmarks/h200_bench.sh eagle        demo target -> EAGLE-3 head -> evaluate -> bundle
#   bash benchmarks/h200_bench.sh eagle_sweep [OVERRIDES]  preset=eagle3_sweep through publish (overrides narrow the grid:
#                                            draft.ttt_steps=4,7 distill.max_steps=4000); LIMIT a call, a rerun resumes
#   bash benchmarks/h200_bench.sh eagle_chat   the measured head recipe (preset=eagle3_sweep) on a general-chat domain, CHAT
#                                            (.gpu/alpaca_eval.jsonl: AlpacaEval's 805 instructions, benchmarks/chat_assets.py)
#   bash benchmarks/h200_bench.sh standalone   demo target -> distilled W4A16 draft model, 400 steps (stops after quantize)
#   bash benchmarks/h200_bench.sh pipeline [OVERRIDES]   the gpu preset's draft model as shipped, through evaluate
#                                            (a sweep when an override lists values: draft.num_layers=4,2)
#   bash benchmarks/h200_bench.sh shapes       the draft model's depth and layer choice by measured speed (two sweeps)
#   bash benchmarks/h200_bench.sh decode       bench decode: both drafts side by side, batch 1 and 16, greedy
#   bash benchmarks/h200_bench.sh serve        draftsmith serve on the EAGLE-3 bundle + bench serve
#   bash benchmarks/h200_bench.sh bundles      both bundle kinds of the gpu preset published at once (EAGLE-3 head: STEPS;
#                                            W4A16 draft model: DSTEPS distillation steps, else the preset's)
#   bash benchmarks/h200_bench.sh vllm [KINDS] vLLM 0.24 (carried, see benchmarks/vllm_site.sh) serving the newest bundle of
#                                            each kind through its serve.sh, vLLM without speculation and draftsmith serve
#                                            on each: vLLM's acceptance against eval.json, then a warm-up and ROUNDS (3)
#                                            rounds of bench serve at 1, 16, 64, DURATION (10) s a level; the table gives
#                                            medians and ranges (KINDS: any of plain eagle3 draft_model, all by default;
#                                            one kind a call stays under the 10 minutes a call may take)
#   bash benchmarks/h200_bench.sh compare      each bundle (BUNDLES, else the newest) served in process, then its engine
#                                            alone: server / engine, 3 rounds, and the engine and HTTP threads' CPU shares
#   bash benchmarks/h200_bench.sh qwen_coder [OVERRIDES]   preset=qwen_coder's three drafts of Qwen2.5-Coder-1.5B (a sweep;
#                                            LIMIT a call, a rerun resumes), then bench decode on those that succeeded and prompt lookup, after joining
#                                            the files that benchmarks/qwen_coder_assets.py --pieces cut, carried one piece
#                                            a call into $ROOT/qwen_coder/ (27 calls of ~5 s on a warm machine)
#   bash benchmarks/h200_bench.sh gemv         serve/gemv.py: its GPU tests, gemv_probe at 1 and 6 rows, profile_shape's plain
#                                            step and verification with and without it, three rounds at three shapes (then
#                                            GEMV=0 ... decode: bench decode with it off)
#   bash benchmarks/h200_bench.sh batch        where batch 16's time goes: launches, hand-outs, admissions, a cProfile
#   bash benchmarks/h200_bench.sh attention    the target's forward by cache size, batch, tokens and attention kernel
#   bash benchmarks/h200_bench.sh profile8b    where a plain step and a verification go at the Llama-3.1-8B shape (random weights)
#   bash benchmarks/h200_bench.sh scale [SHAPE]   bench shapes: plain, verify and both draft kinds' steps at SHAPE
#                                            (llama-3.1-8b), batch 1 and 16, K 2 and 4, projected at alpha ALPHA (0.76)
#   bash benchmarks/h200_bench.sh put          keeps the carried .gpu/qwen_coder/ pieces in $ROOT/qwen_coder (a call each)
#   bash benchmarks/h200_bench.sh bg MODE [ARGS]   MODE (or a script) in the background (LIMIT 3000), its results in $ROOT/out;
#   bash benchmarks/h200_bench.sh wait [SECS]  then calls of this, back to back, until it says "finished" (e.g.
#                                            `bg qwen_coder distill.max_steps=300 evaluate.num_prompts=64`: 17 min on an H100
#                                            on 2026-12-05 with two jobs stopped in quantize, ~23 min whole; after 27 puts)
# Settings (environment, with defaults): ROOT (/root/draftsmith-gpu), where runs and the target cache persist while
# the machine stays up; OUT ($OUT, else /tmp/out), where results go; PORT (8011), the server's. LIMIT (seconds, 570)
# bounds each pipeline run, so that what finished is still copied out; a rerun resumes the rest (the gpu
# preset's pipeline takes ~590 s on a fresh machine: the teacher ~67 s, 8,000 compiled steps ~400 s, so there the
# first call stops in the evaluate stage and a second finishes it in ~80 s). STEPS: the
# EAGLE-3 head's training steps (2000). `eagle` also copies its bundle (~20 MB) to $OUT/bundle: kept here
# under .gpu/bundle and carried to a later machine, BUNDLE=.gpu/bundle lets decode, serve, compare and
# batch skip the head's training (the demo target is converted into the cache where the bundle expects it).
# GEMV=0 runs the CLI's commands (bench decode, bench shapes) with serve/gemv.py off (cuBLAS for every product).
# PROMPTS (8): the held-out prompts of qwen_coder's bench decode, KS ("3 5") its K values, LOOKUP (--lookup) its
# lookup rows (decode's: none; "--lookup --device-lookup": lookup first on the host and on the device side by side).
# JOBS (3): the jobs of qwen_coder's sweep, fewer where an override narrows it (draft=sibling,eagle3: 2).
# STOP_AT_EOS=1 ends decode's answers at EOS (bench decode --stop-at-eos). DRAFTS (HF dirs, space-separated)
# replaces decode's drafts; `best` there is the best job of the newest `shapes` sweep, `spread4` its 4-layer
# spread draft and `shipped` the W4A16 drafts of the newest sweep's jobs (`pipeline`), best first.
set -euo pipefail
root=${ROOT:-/root/draftsmith-gpu}
out=${OUT:-/tmp/out}
port=${PORT:-8011}
mkdir -p "$out"
cli=(python3 -m draftsmith.pipeline.cli)
if [ "${GEMV:-1}" = 0 ]; then  # the CLI with serve/gemv.py off (model.USE_GEMV), in this process
  cli=(python3 -c "from draftsmith.serve import model; model.USE_GEMV = False; from draftsmith.pipeline.cli import main; main()")
fi
limit=${LIMIT:-570}
newest() { ls -td $1 2>/dev/null | head -1; }
get() { python3 -c "import sys, urllib.request; sys.stdout.write(urllib.request.urlopen('http://127.0.0.1:${PORT:-$port}$1').read().decode())"; }
common=(preset=gpu tracking.enabled=false target.cache_dir=$root/cache paths.root=$root/runs)
# the EAGLE-3 head as measured best (preset=eagle3_sweep without -m; RESULTS.md, 2026-12-04), STEPS steps
steps=${STEPS:-2000}
eagle=(preset=eagle3_sweep "${common[@]:1}" distill.max_steps=$steps distill.eval_every=$((steps < 500 ? steps : 500)))

# the published bundle: BUNDLE if given (a carried copy), else this machine's newest
bundle() {
  if [ -n "${BUNDLE:-}" ]; then
    python3 -c "from pathlib import Path; from draftsmith.pipeline.target import convert_gguf, demo_gguf_path; convert_gguf(demo_gguf_path(), Path('$root/cache'))" >/dev/null
    echo "$BUNDLE"
  else
    echo "$(newest "$root/runs/publish/*")/bundle"
  fi
}

# the newest published bundle whose speculative config has this method (eagle3, draft_model)
bundle_of() {
  for b in $(ls -td "$root"/runs/publish/*/bundle 2>/dev/null); do
    if grep -q "\"method\": \"$1\"" "$b/speculative_config.json"; then echo "$b"; return; fi
  done
}
# start a server (name, port, path that answers 200 once it is ready, command...) in its own process group
up() {
  local name=$1 p=$2 path=$3; shift 3
  setsid "$@" > "$out/serve_$name.log" 2>&1 &
  server=$!
  for _ in $(seq 600); do
    PORT=$p get "$path" >/dev/null 2>&1 && return 0
    kill -0 $server 2>/dev/null || { tail -20 "$out/serve_$name.log"; return 1; }
    sleep 1
  done
  return 1
}
down() { kill -- -"$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true; sleep 2; }
load() {  # name port: a 3-second warm-up (not kept), then ROUNDS (3) rounds of bench serve at concurrency 1, 16 and 64
  "${cli[@]}" bench serve --url "http://127.0.0.1:$2" --concurrency 16 --duration 3 > /dev/null 2>&1 || true
  for r in $(seq "${ROUNDS:-3}"); do
    "${cli[@]}" bench serve --url "http://127.0.0.1:$2" --concurrency 1 --concurrency 16 --concurrency 64 \
      --duration "${DURATION:-10}" --out "$out/bench_$1_round$r.json" 2>&1 | tail -6
  done
}

sweep_results() {  # prefix: each job of the newest sweep: its result.json and eval.md to $out
  local sweep job n
  sweep=$(newest "$root/runs/hydra/multirun/*")
  for job in "$sweep"/*/; do
    n=$(basename "$job")
    cp "$job/result.json" "$out/$1_$n.json" || true
    cp "$(python3 -c "import json; print(json.load(open('$job/result.json'))['outputs']['evaluate'])")/eval.md" "$out/$1_${n}_eval.md" || true
  done
}

case "${1:?tests, train, eagle, eagle_sweep, eagle_chat, standalone, pipeline, shapes, decode, serve, bundles, vllm, compare, qwen_coder, gemv, batch, attention, profile8b, scale, put, bg or wait}" in
put)  # the pieces this call carried (.gpu/qwen_coder/*, one of 60 MiB a call) kept in $ROOT/qwen_coder
  mkdir -p "$root/qwen_coder"
  cp -n .gpu/qwen_coder/* "$root/qwen_coder/" 2>/dev/null || true
  echo "$(ls "$root/qwen_coder" | grep -c '\.part') pieces, $(du -sh "$root/qwen_coder" | cut -f1)"
  ;;
bg)  # the rest of the line in the background, past a call's 10 minutes while the machine stays warm (LIMIT 3000)
  shift
  rm -f "$root/bg.done"
  mkdir -p "$root/out"
  # each later call copies the working tree over this one: a run that imports a module meanwhile (a sweep's next
  # job) met a half-copied file, so the run goes on in a copy of its own, installed editable from there
  snap=$root/snapshot
  rm -rf "$snap" && mkdir -p "$snap" && tar --exclude=./.gpu --exclude=./.whl --exclude="./.venv*" --exclude=./.git -cf - . | tar -xf - -C "$snap"
  ln -s "$PWD/.gpu" "$snap/.gpu"
  (cd "$snap" && python3 -m pip install -q --no-deps --no-build-isolation --no-cache-dir -e . >/dev/null)
  run=(benchmarks/h200_bench.sh); [ -f "$1" ] && run=()  # a script of several steps (e.g. in .gpu/) instead of a mode
  setsid nohup bash -c 'cd "$1/snapshot" && OUT="$1/out" LIMIT="$2" bash "${@:3}"; touch "$1/bg.done"' \
    _ "$root" "${LIMIT:-3000}" "${run[@]}" "$@" > "$root/bg.log" 2>&1 < /dev/null &
  echo "started: $*"
  ;;
wait)  # until the background run ends, at most ${2:-280} s: its stages and log, then what it wrote so far to $OUT
  end=$((SECONDS + ${2:-280}))
  until [ -f "$root/bg.done" ] || [ $SECONDS -ge $end ]; do sleep 5; done
  grep -hE "stage [a-z]+: (ran|failed)" "$root"/runs/hydra/multirun/*/*/*.log 2>/dev/null | tail -8 || true
  tail -5 "$root/bg.log"
  if [ -f "$root/bg.done" ]; then echo "finished"; else echo "still running"; fi
  cp "$root"/out/* "$out"/ 2>/dev/null || true
  ;;
tests)
  python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graphs.py tests/test_model.py tests/test_penalties.py tests/test_eagle.py 2>&1 | tail -15
  ;;
train)  # further arguments go to profile_train (--variant, --batch, --profile)
  shift
  python3 benchmarks/profile_train.py --cache-dir $root/cache "$@"
  ;;
eagle)
  timeout "$limit" "${cli[@]}" run "${eagle[@]}" stop_after=publish 2>&1 | tail -60 || true
  for s in teacher distill evaluate publish; do cp "$(newest "$root/runs/$s/*")/stage.json" "$out/${s}_stage.json" || true; done
  cp "$(newest "$root/runs/evaluate/*")"/{eval.json,eval.md} "$out/" || true
  cp -r "$(newest "$root/runs/publish/*")/bundle" "$out/bundle" || true
  ;;
eagle_chat)  # the measured head recipe on a general-chat domain: CHAT (.gpu/alpaca_eval.jsonl, benchmarks/chat_assets.py)
  timeout "$limit" "${cli[@]}" run "${eagle[@]}" data.path="$(realpath "${CHAT:-.gpu/alpaca_eval.jsonl}")" \
    stop_after=publish 2>&1 | tail -40 || true
  for f in eval.json eval.md; do cp "$(newest "$root/runs/evaluate/*")/$f" "$out/chat_$f" || true; done
  for s in teacher distill evaluate; do cp "$(newest "$root/runs/$s/*")/stage.json" "$out/chat_${s}_stage.json" || true; done
  ;;
standalone)
  timeout "$limit" "${cli[@]}" run "${common[@]}" distill.max_steps=400 distill.eval_every=400 stop_after=quantize 2>&1 | tail -40 || true
  for s in distill quantize; do cp "$(newest "$root/runs/$s/*")/stage.json" "$out/standalone_${s}_stage.json" || true; done
  ;;
pipeline)
  shift
  timeout "$limit" "${cli[@]}" run -m "${common[@]}" stop_after=evaluate "$@" 2>&1 | tail -30 || true
  sweep_results pipeline
  ;;
eagle_sweep)
  shift
  timeout "$limit" "${cli[@]}" run -m preset=eagle3_sweep "${common[@]:1}" stop_after=publish "$@" 2>&1 | tail -30 || true
  sweep_results eagle_sweep
  ;;
shapes)
  # every job: 300 steps (~6.7M tokens), no AWQ (a draft's int4 weights are dequantized at load, so its
  # speed is its bf16 speed), evaluate at batch 1 on 32 held-out prompts; the gates do not stop a job
  steps=${STEPS:-300}
  sweep=("${common[@]}" stop_after=evaluate quantize.enabled=false distill.max_steps=$steps distill.eval_every=$steps
         evaluate.batch_size=1 evaluate.num_prompts=32 evaluate.min_alpha=0)
  end=$((SECONDS + limit))  # LIMIT bounds both sweeps together; a rerun resumes (finished jobs are cached)
  timeout "$limit" "${cli[@]}" run -m "${sweep[@]}" draft.num_layers=1,2,3,4,6 2>&1 | tail -25 || true
  if [ $((end - SECONDS)) -gt 30 ]; then
    timeout $((end - SECONDS)) "${cli[@]}" run -m "${sweep[@]}" draft.num_layers=2,4 draft.layer_choice=first,last 2>&1 | tail -15 || true
  fi
  for f in "$root"/runs/hydra/multirun/*/*/result.json; do cp "$f" "$out/$(basename "$(dirname "$(dirname "$f")")")_$(basename "$(dirname "$f")").json"; done
  ;;
decode)
  drafts=()
  if [ -n "${DRAFTS:-}" ]; then
    for d in $DRAFTS; do
      case $d in  # best: the best job of the `shapes` sweeps; spread4: their 4-layer spread draft
        shipped) for q in $(python3 -c "
from pathlib import Path; from draftsmith.pipeline.sweep import rank, read_results
sweep = sorted(Path('$root/runs/hydra/multirun').iterdir())[-1]
print(' '.join(r['outputs']['quantize'] + '/draft' for r in rank(read_results(sweep)) if 'quantize' in r['outputs']))"); do
            drafts+=(--draft "$q"); done; continue;;
        best|spread4) d=$(python3 -c "
from pathlib import Path; from draftsmith.pipeline.sweep import rank, read_results
rs = [r for r in rank(read_results(Path('$root/runs/hydra/multirun'))) if r['status'] == 'ok']
rs = rs if '$d' == 'best' else [r for r in rs if 'draft.num_layers=4' in r['overrides'] and not any('layer_choice' in o for o in r['overrides'])]
print(rs[0]['outputs']['distill'] + '/draft')");;
      esac
      drafts+=(--draft "$d")
    done
  else
    drafts+=(--draft "$(bundle)/draft")
    standalone=$(newest "$root/runs/quantize/*/draft" || true)  # only where `standalone` ran on this machine
    if [ -n "$standalone" ]; then drafts+=(--draft "$standalone"); fi
  fi
  "${cli[@]}" bench decode --device cuda --prompts 8 --new-tokens 256 --batch 16 --k 2 --k 3 --k 4 --k 5 --repeats 3 \
    ${STOP_AT_EOS:+--stop-at-eos} ${LOOKUP:-} "${drafts[@]}" --cache-dir $root/cache --out "$out/bench_decode.json"
  ;;
serve)
  "${cli[@]}" serve "$(bundle)" --device cuda --port "$port" > "$out/serve.log" 2>&1 &
  server=$!
  trap 'kill $server 2>/dev/null || true' EXIT
  for _ in $(seq 600); do
    get /ready >/dev/null 2>&1 && break
    kill -0 $server 2>/dev/null || { tail -20 "$out/serve.log"; exit 1; }
    sleep 1
  done
  "${cli[@]}" bench serve --url "http://127.0.0.1:$port" --concurrency 1 --concurrency 16 --duration 20 --out "$out/bench_serve.json"
  get /metrics | grep -E '^draftsmith.spec_decode' | head -20 || true
  ;;
bundles)
  limit=${LIMIT:-900}
  "${cli[@]}" run "${common[@]}" stop_after=data 2>&1 | tail -3  # the stages both share, once
  # both trainers share the GPU; then each evaluates alone (step costs timed beside another job's training are
  # noise: a W4A16 draft evaluated so shipped K=8 and measured 1.13x, K=3 and 1.52x on an idle GPU)
  draft_model=(${DSTEPS:+distill.max_steps=$DSTEPS distill.eval_every=$DSTEPS})
  timeout "$limit" "${cli[@]}" run "${eagle[@]}" stop_after=quantize > "$out/bundles_eagle3.log" 2>&1 &
  sleep 5  # distinct run dirs
  timeout "$limit" "${cli[@]}" run "${common[@]}" "${draft_model[@]}" stop_after=quantize > "$out/bundles_draft_model.log" 2>&1 &
  wait
  timeout "$limit" "${cli[@]}" run "${eagle[@]}" stop_after=publish ${GATE:+evaluate.min_alpha=$GATE} >> "$out/bundles_eagle3.log" 2>&1
  timeout "$limit" "${cli[@]}" run "${common[@]}" "${draft_model[@]}" stop_after=publish ${GATE:+evaluate.min_alpha=$GATE} >> "$out/bundles_draft_model.log" 2>&1
  for kind in eagle3 draft_model; do tail -4 "$out/bundles_$kind.log"; b=$(bundle_of $kind); echo "$kind: ${b:-not published}"; done
  ;;
vllm)
  site=$root/vllm-site
  if [ ! -f "$site/.done" ]; then
    test "$(cat "$root"/vllm/part* | sha256sum | cut -c1-64)" = "$(cat "$root/vllm/sha256")" || { echo "vllm parts incomplete"; exit 1; }
    mkdir -p "$site"
    cat "$root"/vllm/part* | python3 -c "import sys, tarfile; tarfile.open(fileobj=sys.stdin.buffer, mode='r|gz').extractall(sys.argv[1], filter='fully_trusted')" "$site"
    touch "$site/.done"
  fi
  mkdir -p "$root/bin"  # `vllm` as the bundle's serve.sh calls it, on vLLM's own libraries (not ours)
  printf '#!/bin/sh\nPYTHONPATH=%s exec python3 -m vllm.entrypoints.cli.main "$@"\n' "$site" > "$root/bin/vllm"
  printf '#!/bin/sh\nexec python3 -m draftsmith.pipeline.cli "$@"\n' > "$root/bin/draftsmith"
  chmod +x "$root/bin/vllm" "$root/bin/draftsmith"
  export PATH="$root/bin:$PATH" VLLM_USE_FLASHINFER_SAMPLER=0  # flashinfer is not carried: vLLM samples with torch
  shift
  kinds=${*:-plain eagle3 draft_model}
  target=$(python3 -c "import sys; from pathlib import Path; from draftsmith.pipeline.bundle import target_dir_of; print(target_dir_of(Path(sys.argv[1]), None))" "$(bundle)")
  for kind in $kinds; do
    if [ "$kind" = plain ]; then
      if up vllm_plain 8101 /v1/models vllm serve "$target" --max-model-len 2048 --port 8101; then load vllm_plain 8101; fi; down
      continue
    fi
    b=$(bundle_of "$kind")
    if up "vllm_$kind" 8102 /v1/models bash "$b/serve.sh" vllm --port 8102; then
      python3 pipeline/vllm_check.py "$b" --url http://127.0.0.1:8102 --out "$out/vllm_check_$kind.json" || true
      load "vllm_$kind" 8102
    fi
    down
    if up "draftsmith_$kind" 8103 /ready bash "$b/serve.sh" draftsmith --device cuda --port 8103 --max-batch-size 64; then
      load "draftsmith_$kind" 8103
    fi
    down
  done
  python3 benchmarks/serving_table.py "$out"
  ;;
compare)
  for b in ${BUNDLES:-$(bundle)}; do
    COLUMNS=200 "${cli[@]}" bench serve --compare-engine "$b" --device cuda --concurrency 1 --concurrency 16 \
      --duration "${DURATION:-15}" --repeats 3 --out "$out/bench_serve_compare_$(basename "$(dirname "$b")").json" 2>&1 | tail -8
  done
  ;;
qwen_coder)
  assets=$HOME/.cache/draftsmith/qwen_coder  # where the preset looks
  mkdir -p "$assets"
  for sum in "$root"/qwen_coder/*.sha256; do
    file=$assets/$(basename "$sum" .sha256)
    [ -f "$file" ] || { cat "${sum%.sha256}".part* > "$file.tmp" && mv "$file.tmp" "$file"; }
    test "$(sha256sum "$file" | cut -c1-64)" = "$(cut -c1-64 "$sum")" || { echo "$file: pieces missing or changed"; rm -f "$file"; exit 1; }
  done
  timeout "$limit" "${cli[@]}" run -m preset=qwen_coder tracking.enabled=false target.cache_dir=$root/cache paths.root=$root/runs \
    stop_after=publish "${@:2}" 2>&1 | tail -30 || true
  sweep_results qwen_coder
  # once every job has ended: one bench decode run on the drafts the jobs that succeeded ship (a failed job is
  # named and left out), on held-out prompts of the domain
  drafts=$(python3 - "$(newest "$root/runs/hydra/multirun/*")" <<'PY'
import json, os, sys
from pathlib import Path
jobs = [json.loads(p.read_text()) for p in sorted(Path(sys.argv[1]).glob("*/result.json"))]
if len(jobs) == int(os.environ.get("JOBS", 3)):
    for job in jobs:
        if job["status"] != "ok":
            print(f"qwen_coder: a job failed and is left out of the bench: {str(job.get('error'))[:300]}", file=sys.stderr)
            continue
        out = job["outputs"]
        quantized = out.get("quantize", "") + "/draft"
        print("--draft", quantized if os.path.isfile(quantized + "/config.json") else out["distill"] + "/draft")
PY
)
  [ -n "$drafts" ] || { echo "qwen_coder: the sweep has not finished (or every job failed); run again to resume"; exit 0; }
  # PROMPTS (8): held-out prompts at batch 1. On the first 8, prompt lookup's tau at K = 5 was 3.43 against 2.51
  # on the evaluate stage's 128; 16 tell more but add ~2 minutes to a run that takes ~23 of a session's 30
  "${cli[@]}" bench decode --device cuda --target "$assets"/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf --data "$assets"/code_prompts.jsonl \
    --eval-fraction 0.2 --prompts "${PROMPTS:-8}" --new-tokens 128 --batch 16 $(printf -- "--k %s " ${KS:-3 5}) --repeats 3 $drafts ${LOOKUP:---lookup} --cache-dir $root/cache \
    --out "$out/bench_decode_qwen_coder.json" 2>&1 | tail -30
  ;;
gemv)  # serve/gemv.py against cuBLAS: its GPU tests, its tiles at 1 and 6 rows, three rounds at three shapes
  # the GPU's own tests (tests/test_gemv.py's interpreter sums are numpy's: bit for bit alike only on the CPU machines)
  python3 -m pytest -q -p no:cacheprovider tests/test_gemv.py::test_the_model_keeps_torch_products_where_the_kernel_does_not_run \
    tests/test_cuda_graphs.py -k gemv 2>&1 | tail -5
  for rows in 1 6; do python3 benchmarks/gemv_probe.py --shape llama-3.1-8b --rows $rows --quick 2>&1 | tail -n 10; done
  for shape in llama-3.1-8b qwen2.5-1.5b smollm2-135m; do
    python3 benchmarks/profile_shape.py --shape $shape --variants default cuBLAS --repeats 3 2>&1 | tail -n 4
  done
  ;;
batch)
  python3 benchmarks/profile_batch.py --draft "$(bundle)/draft" --cache-dir $root/cache
  ;;
attention)
  python3 benchmarks/profile_attention.py --cache-dir $root/cache
  ;;
profile8b)
  python3 benchmarks/profile_shape.py --shape llama-3.1-8b --batch 1 2>&1 | tee "$out/profile_shape.txt" | tail -25
  ;;
scale)
  "${cli[@]}" bench shapes --shape "${2:-llama-3.1-8b}" --batch 1 --batch 16 --k 2 --k 4 --alpha "${ALPHA:-0.76}" --repeats 3 \
    --out "$out/bench_shapes_${2:-llama-3.1-8b}.json"
  ;;
esac
