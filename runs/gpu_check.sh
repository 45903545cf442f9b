#!/usr/bin/env bash
# One command that checks flaxchat on a GPU machine whose JAX (with CUDA) is already installed, with no network:
# install flaxchat around that JAX, confirm JAX is on the GPU, run the GPU tests, benchmark training (d12 and d20
# with sliding windows, d12 with global attention; d12 with 2 accumulation steps on random tokens and on real
# batches from the data loader), generation (batch 1, 32) and serving, and write one report (report.json +
# summary.md).
#
#   # 1. on a machine with network, once: the wheels of flaxchat's pure-Python dependencies (not JAX, not CUDA)
#   bash runs/gpu_check.sh --fetch-wheels wheels/      # same OS and Python as the GPU machine, or add after --:
#   bash runs/gpu_check.sh --fetch-wheels wheels/ -- --python-version 3.12 --platform manylinux_2_28_x86_64 \
#        --platform manylinux_2_17_x86_64 --only-binary=:all:
#   # 2. copy the repository and wheels/ to the GPU machine, then, offline:
#   bash runs/gpu_check.sh --wheels wheels/            # or FLAXCHAT_WHEELS=wheels/ bash runs/gpu_check.sh
#   # with nanochat's own training step timed on the same shapes first (a nanochat checkout; its PyTorch with CUDA):
#   bash runs/gpu_check.sh --nanochat ~/src/nanochat
#   # and where each training step's time goes, flaxchat's kernels beside nanochat's:
#   bash runs/gpu_check.sh --nanochat ~/src/nanochat --profile
#   # the same sequence with tiny models on the CPU, in ~1 minute (CI runs it: tests/test_gpu.py):
#   bash runs/gpu_check.sh --cpu --out /tmp/gpu_check
#
# Output (--out, default $FLAXCHAT_BASE_DIR/gpu_check/<date-time>/): report.json (every step's JSON), summary.md
# (the tables), and per step NAME.cmd (the exact command), NAME.out (its stdout), NAME.rc, logs/NAME.log (stderr).
# Exit status 0 only if every step passed; a JAX that is not on the GPU stops everything at step 2.
set -euo pipefail
cd "$(dirname "$0")/.."

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; cat <<'EOF'

Options:
  --out DIR            output folder (default: $FLAXCHAT_BASE_DIR/gpu_check/<date-time>)
  --wheels DIR         local wheel folder to install missing dependencies from (pip --no-index --find-links);
                       also $FLAXCHAT_WHEELS. Not needed when flaxchat and its dependencies are installed.
  --only SECTIONS      run only these of tests,train,real,generate,serve (comma-separated; default all): e.g.
                       --only real for the real-pipeline rows alone, to fit a short lease; the report checks
                       only what ran
  --profile            profile three timed steps of each training shape (and nanochat's, with --nanochat): the
                       summary adds where each step's time goes (ms by kind of op, the slowest ops); traces in
                       OUT/profile/
  --no-install         install nothing: run with the packages as they are (what falls short of flaxchat's
                       requirements is listed, in missing.txt too, and used anyway)
  --cpu                smoke mode: the same steps with tiny models on the CPU (--expect-backend cpu)
  --nanochat DIR       time nanochat's training step (the checkout at DIR: its GPT, MuonAdamW, torch.compile, with
                       the PyTorch installed here) on each training shape before flaxchat's; the report adds
                       nanochat's tok/s and the ratio. With the real section, also a pair of real runs (its
                       scripts/base_train.py, then scripts.pretrain, on the same shards; bench --what run)
  --fetch-wheels DIR   (networked machine) download those wheels into DIR, then stop; arguments after -- go to
                       pip download
  -h, --help           this text
Environment: XLA_PYTHON_CLIENT_MEM_FRACTION (default 0.92), JAX_COMPILATION_CACHE_DIR (default
$FLAXCHAT_BASE_DIR/jax_cache), JAX_PLATFORMS (default cuda; cpu with --cpu).
EOF
}

MODE=gpu OUT="" WHEELS=${FLAXCHAT_WHEELS:-} FETCH="" PIP_EXTRA=() NANOCHAT=() INSTALL=yes PROFILE=no
ALL_SECTIONS=tests,train,real,generate,serve ONLY=$ALL_SECTIONS
while [ $# -gt 0 ]; do
    case $1 in
        --out) OUT=$2; shift 2 ;;
        --wheels) WHEELS=$2; shift 2 ;;
        --cpu) MODE=cpu; shift ;;
        --nanochat) NANOCHAT=(--nanochat "$2"); shift 2 ;;
        --no-install) INSTALL=no; shift ;;
        --profile) PROFILE=yes; shift ;;
        --only) ONLY=$2; shift 2 ;;
        --fetch-wheels) FETCH=$2; shift 2 ;;
        --) shift; PIP_EXTRA=("$@"); break ;;
        -h|--help) usage; exit 0 ;;
        *) echo "gpu_check: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done

[ -n "${ONLY//,/}" ] || { echo "gpu_check: --only needs at least one of $ALL_SECTIONS" >&2; exit 2; }
for section in ${ONLY//,/ }; do
    case ",$ALL_SECTIONS," in
        *",$section,"*) ;;
        *) echo "gpu_check: --only $ONLY: unknown section $section (choose from $ALL_SECTIONS)" >&2; exit 2 ;;
    esac
done
wanted() { case ",$ONLY," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }

# --- 0. (networked machine) fetch the wheels -----------------------------------------------------------------
if [ -n "$FETCH" ]; then
    mkdir -p "$FETCH"
    python -m scripts.gpu_check requirements > "$FETCH/requirements.txt"
    # Tested versions (requirements/*.txt share them; the CUDA lines are not asked for here). setuptools + wheel
    # let `pip install --no-index -e .` build flaxchat offline. jax/jaxlib come along as flax's dependencies;
    # the offline install never uses them (the GPU machine's own JAX is kept).
    python -m pip download -d "$FETCH" -c requirements/cuda13.txt -r "$FETCH/requirements.txt" \
        "setuptools>=68" wheel ${PIP_EXTRA[@]+"${PIP_EXTRA[@]}"}
    echo "gpu_check: wheels in $FETCH; on the GPU machine: bash runs/gpu_check.sh --wheels $FETCH"
    exit 0
fi

BASE=${FLAXCHAT_BASE_DIR:-$HOME/.cache/flaxchat}
OUT=${OUT:-$BASE/gpu_check/$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT/logs"
OUT=$(cd "$OUT" && pwd)
# a reused --out folder: drop the last run's step records, so the report holds this run's steps only
rm -f "$OUT"/*.cmd "$OUT"/*.out "$OUT"/*.rc "$OUT"/*.note "$OUT"/logs/*.log \
    "$OUT"/tests.xml "$OUT"/env.json "$OUT"/report.json "$OUT"/summary.md "$OUT"/missing.txt "$OUT"/keep.txt
# JAX takes 75% of GPU memory by default; the benchmarks want nearly all of it (export your own value to override).
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}
# Compiled programs persist: a second check (or a later pretraining run of the same shapes) skips compilation.
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$BASE/jax_cache}
export PYTHONUNBUFFERED=1
if [ "$MODE" = gpu ]; then
    # Name the platform: JAX would otherwise fall back to the CPU with one log line (and tests/conftest.py pins
    # the CPU unless JAX_PLATFORMS is set).
    export JAX_PLATFORMS=${JAX_PLATFORMS:-cuda}
    BACKEND=gpu DTYPE=bfloat16 T=2048 VOCAB=32768        # nanochat's d20 setting (runs/speedrun.sh's vocabulary)
    # depth, window pattern, then device batch sizes to try (nanochat: 32). Sliding windows are nanochat's default;
    # all-global (L) attention is the fair comparison where nanochat's Flash Attention 3 cannot load
    TRAIN=("12 SSSL 32 16 8" "20 SSSL 32 16 8" "12 L 32 16 8")
    BENCH_STEPS=(--steps 10 --warmup 2) PROFILE_STEPS=5:8    # three of the ten timed steps (step 0 compiles)
    # the real pipeline (4b): depth, rows, tokenizer vocabulary (synthetic stories hold ~4k tokens' worth of merges),
    # stories per shard; 30 timed steps, three late ones profiled, since a real run's steps can slow as it goes
    REAL=(12 32 4096 20000) REAL_STEPS=(--steps 30 --warmup 2) REAL_PROFILE_STEPS=27:30
    RUN_STEPS=(--steps 60 --warmup 9)  # with --nanochat, real runs side by side: the median of steps 11-60
    GEN_DEPTH=20 GEN_T=2048 GEN_BATCHES=(1 32) GEN_LEN=(--prompt-len 16 --max-new-tokens 256)
    GPU_TESTS=()  # every test marked gpu, wherever it lives
    SERVE=(--depth 20 --seq-len 2048 --slots 32 --load-test 1,32 --load-tokens 256 --load-repeats 3)
else
    export JAX_PLATFORMS=cpu
    # one CPU device, whatever tests/conftest.py asked for (its fake 8 devices would split these tiny batches)
    XLA_FLAGS=$(echo "${XLA_FLAGS:-}" | sed 's/--xla_force_host_platform_device_count=[0-9]*//; s/^ *//; s/ *$//')
    if [ -n "$XLA_FLAGS" ]; then export XLA_FLAGS; else unset XLA_FLAGS; fi
    BACKEND=cpu DTYPE=float32 T=64 VOCAB=512
    TRAIN=("2 SSSL 2")  # one tiny model: the smoke is about the sequence, the GPU run about d12 and d20
    BENCH_STEPS=(--steps 2 --warmup 1) PROFILE_STEPS=2:4
    REAL=(2 2 512 1000) REAL_STEPS=(--steps 2 --warmup 1) REAL_PROFILE_STEPS=2:4 RUN_STEPS=(--steps 4 --warmup 1)
    GEN_DEPTH=2 GEN_T=128 GEN_BATCHES=(1 4) GEN_LEN=(--prompt-len 8 --max-new-tokens 16)
    GPU_TESTS=(tests/test_gpu.py)  # collecting only the file that holds them: the smoke is about the sequence
    SERVE=(--depth 2 --seq-len 128 --slots 4 --load-test 1,4 --load-tokens 16 --load-repeats 1)
fi
echo "gpu_check ($MODE): output in $OUT"

# step NAME CMD...: run CMD, keeping its command line, stdout, stderr and exit status under $OUT
step() {
    local name=$1 rc t0=$SECONDS
    shift
    printf '%s\n' "$*" > "$OUT/$name.cmd"
    echo "== $name: $*"
    set +e
    "$@" > "$OUT/$name.out" 2> "$OUT/logs/$name.log"
    rc=$?
    set -e
    echo "$rc" > "$OUT/$name.rc"
    if [ "$rc" -ne 0 ]; then
        echo "   FAILED (exit $rc, $((SECONDS - t0)) s); last lines of logs/$name.log:"
        tail -n 5 "$OUT/logs/$name.log" | sed 's/^/   | /'
    else
        echo "   ok ($((SECONDS - t0)) s)"
    fi
    return "$rc"
}

# --- 1. install flaxchat around the installed JAX (offline) ---------------------------------------------------
MISSING=$(python -m scripts.gpu_check missing)
if [ -z "$MISSING" ] && python -c "import importlib.metadata as m; m.distribution('flaxchat')" 2>/dev/null; then
    echo "== install: flaxchat and its dependencies are installed; nothing to do"
elif [ "$INSTALL" = no ]; then
    # the scripts run from this folder, so flaxchat need not be installed; older versions are used as they are
    echo "== install: skipped (--no-install); not satisfied here:" ${MISSING:-nothing}
    echo "$MISSING" > "$OUT/missing.txt"
else
    if [ -z "$WHEELS" ]; then
        echo "gpu_check: missing:" $MISSING >&2
        echo "gpu_check: fetch their wheels on a networked machine (bash runs/gpu_check.sh --fetch-wheels wheels/)," \
             "copy wheels/ here, and pass --wheels wheels/ (or FLAXCHAT_WHEELS)" >&2
        exit 1
    fi
    # The installed JAX, its CUDA plugin and NVIDIA libraries are pinned as they are: nothing may replace them.
    python -m scripts.gpu_check pins > "$OUT/keep.txt"
    echo "== install: $(printf '%s' "$MISSING" | grep -c .) requirements from $WHEELS, keeping $(wc -l < "$OUT/keep.txt") JAX/CUDA packages"
    if [ -n "$MISSING" ]; then
        echo "$MISSING" > "$OUT/missing.txt"
        python -m pip install --no-index --find-links "$WHEELS" -c "$OUT/keep.txt" -r "$OUT/missing.txt"
    fi
    python -m pip install --no-index --find-links "$WHEELS" --no-deps -e .
    python -m scripts.gpu_check pins | diff -u "$OUT/keep.txt" - >&2 \
        || { echo "gpu_check: the install changed the JAX/CUDA packages above" >&2; exit 1; }
fi

# --- 2. JAX must be on the expected backend, or nothing else runs ----------------------------------------------
echo "== env: JAX_PLATFORMS=$JAX_PLATFORMS, expecting $BACKEND"
python -m scripts.gpu_check env --expect-backend "$BACKEND" > "$OUT/env.json"
python - "$OUT/env.json" <<'EOF'
import json, sys
e = json.load(open(sys.argv[1]))
print(f"   {e['backend']}: {e['device_count']} x {e['device_kind']}, jax {e['jax']}", *e["packages"][:4])
EOF

# --- 3. GPU tests (on the CPU they are collected and skipped, each saying why) ----------------------------------
if wanted tests; then
    step tests python -m pytest ${GPU_TESTS[@]+"${GPU_TESTS[@]}"} -m gpu -p no:cacheprovider -rs --junitxml="$OUT/tests.xml" || true
fi

# --- 4. training throughput: tok/s, MFU vs the datasheet bf16 peak, compile time, peak memory --------------------
wanted train || TRAIN=()
for spec in ${TRAIN[@]+"${TRAIN[@]}"}; do
    read -r depth pattern batches <<< "$spec"
    name=train_d$depth$([ "$pattern" = SSSL ] || echo "_$pattern")
    profile=()
    [ "$PROFILE" = yes ] && profile=(--profile-steps "$PROFILE_STEPS" --profile-dir "$OUT/profile/$name")
    for b in $batches; do
        if step "$name" python -m scripts.bench --what train --depth "$depth" --max-seq-len "$T" --vocab-size "$VOCAB" \
                --window-pattern "$pattern" --dtype "$DTYPE" --device-batch-size "$b" "${BENCH_STEPS[@]}" \
                --expect-backend "$BACKEND" ${NANOCHAT[@]+"${NANOCHAT[@]}"} ${profile[@]+"${profile[@]}"}; then
            break
        fi
        # only running out of memory is worth a smaller batch
        grep -qiE "RESOURCE_EXHAUSTED|out of memory" "$OUT/logs/$name.log" || break
        echo "out of memory at --device-batch-size $b" >> "$OUT/$name.note"
    done
done

# --- 4b. the real pipeline against random tokens of the same shape: every-layer-global d12 (d2 with --cpu), 2
# accumulation steps, batches from the Grain loader over synthetic stories with a tokenizer trained on them. Random
# tokens leave out the loader, the host-to-device copies, the text's token statistics and a model that learns; what
# the real row loses to the random one is what a real run pays for them, and the two rows between split it. No
# nanochat in these rows (its bench step takes random tokens only); with --nanochat, a pair of real runs after them.
read -r REAL_DEPTH REAL_ROWS REAL_VOCAB REAL_DOCS <<< "${REAL[*]}"
REAL_BASE=$OUT/real_base
if wanted real && step real_data python -m scripts.data --source synthetic-stories --num-shards 2 --docs-per-shard "$REAL_DOCS" \
        --out-dir "$REAL_BASE/base_data" --overwrite \
    && step real_tokenizer env FLAXCHAT_BASE_DIR="$REAL_BASE" python -m scripts.tok_train --vocab-size "$REAL_VOCAB"; then
    vocab=$(FLAXCHAT_BASE_DIR="$REAL_BASE" python -c "from flaxchat.data.tokenizer import get_tokenizer as g; print(g().get_vocab_size())")
    # random tokens (two batches on the device), random tokens placed afresh every step, the loader's first two steps
    # cycled (its text, no loader), the loader every step: which of them slows a step down says why. Last, the loader
    # with the fp32 atomic adds as this JAX's LLVM compiles them unasked (FLAXCHAT_NATIVE_GPU_ATOMICS=0: compare-and-
    # swap loops from jaxlib 0.10.2 on), against which the embeddings' gradients, frequent tokens repeated, serialise.
    # Then the loader with each step waited for (--in-flight off), against the default's one step in flight on a GPU
    for data in random random_fresh real_cycled real real_llvm_atomics real_waited; do
        name=train_d${REAL_DEPTH}_${data}_data profile=() native=1
        case $data in
            random) flags=(--vocab-size "$vocab") ;;
            random_fresh) flags=(--vocab-size "$vocab" --fresh-batches) ;;
            real_cycled) flags=(--real-data --cycle-batches 2) ;;
            real) flags=(--real-data) ;;
            real_llvm_atomics) flags=(--real-data) native=0 ;;
            real_waited) flags=(--real-data --in-flight off) ;;
        esac
        [ "$PROFILE" = yes ] && profile=(--profile-steps "$REAL_PROFILE_STEPS" --profile-dir "$OUT/profile/$name")
        (export FLAXCHAT_BASE_DIR=$REAL_BASE FLAXCHAT_NATIVE_GPU_ATOMICS=$native
         step "$name" python -m scripts.bench --what train --depth "$REAL_DEPTH" --max-seq-len "$T" --window-pattern L \
             --dtype "$DTYPE" --device-batch-size "$REAL_ROWS" --grad-accum 2 "${flags[@]}" "${REAL_STEPS[@]}" \
             --expect-backend "$BACKEND" ${profile[@]+"${profile[@]}"}) || true
    done
    # with --nanochat: real runs side by side, nanochat's own base_train, then scripts.pretrain, the same flags on
    # the same shards and tokenizer (bench --what run; both runs' output in logs/run_*.log)
    if [ ${#NANOCHAT[@]} -gt 0 ]; then
        (export FLAXCHAT_BASE_DIR=$REAL_BASE
         step "run_d${REAL_DEPTH}_real" python -m scripts.bench --what run --depth "$REAL_DEPTH" --max-seq-len "$T" \
             --window-pattern L --dtype "$DTYPE" --device-batch-size "$REAL_ROWS" --grad-accum 2 "${RUN_STEPS[@]}" \
             --expect-backend "$BACKEND" "${NANOCHAT[@]}") || true
    fi
fi

# --- 5. generation: KV-cache engine at batch 1 and many rows ----------------------------------------------------
wanted generate || GEN_BATCHES=()
for b in ${GEN_BATCHES[@]+"${GEN_BATCHES[@]}"}; do
    step "generate_b$b" python -m scripts.bench --what generate --depth "$GEN_DEPTH" --max-seq-len "$GEN_T" \
        --vocab-size "$VOCAB" --dtype "$DTYPE" --batch-size "$b" "${GEN_LEN[@]}" --expect-backend "$BACKEND" || true
done

# --- 6. serving: concurrent WebSocket clients against chat_web (random init, a made-up-words tokenizer) ---------
SERVE_BASE=$OUT/serve_base
mkdir -p "$SERVE_BASE" "$JAX_COMPILATION_CACHE_DIR"
ln -sfn "$JAX_COMPILATION_CACHE_DIR" "$SERVE_BASE/jax_cache"   # chat_web keeps compiled programs in its base dir
if wanted serve && step tokenizer python -m scripts.gpu_check tokenizer --vocab-size "$VOCAB" --base-dir "$SERVE_BASE"; then
    step serve env FLAXCHAT_BASE_DIR="$SERVE_BASE" FLAXCHAT_DTYPE="$DTYPE" \
        python -m scripts.chat_web --random-init "${SERVE[@]}" || true
fi

# --- 7. one report --------------------------------------------------------------------------------------------
echo "== report: $OUT/report.json, $OUT/summary.md"
echo
python -m scripts.gpu_check report "$OUT" --mode "$MODE" --sections "$ONLY"
