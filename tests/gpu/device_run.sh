#!/usr/bin/env bash
# `sluice train reasoning_gym` on a GPU machine, end to end: the Prefect flow on its
# temporary API, the roles as processes, MLflow on sqlite, file storage, on CUDA.
#
#   bash tests/gpu/device_run.sh          # on the GPU machine: one call of the plan
#   bash tests/gpu/device_run.sh --cpu    # here: the same commands on CPU, to the first step
#
# The GPU machine has Python 3.12 and PyTorch but not Prefect, MLflow and the rest, and
# no network: `python tests/gpu/device_bundle.py build` lays their cp312 wheels and
# SmolLM2's GGUF out in .device/call1, call2, ... (64 MiB a call with the working tree)
# and prints the plan: each call carries its folder and runs this script. Every call
# stages what it carried under $SLUICE_DEVICE_STATE (/tmp, kept while the machine stays
# warm); the call that finds the wheels installs them (pip --target, no index) and checks
# the imports; the call that completes the GGUF imports it (`sluice model import`) and
# runs `sluice train reasoning_gym` and `sluice train reasoning_gym --sync` for
# $SLUICE_DEVICE_MINUTES each (trainer.time_budget_s), then prints the table
# (tests/gpu/device_report.py). Logs and the table land in $OUT: device.log,
# summary.md, logs.tar.gz.
#
# --cpu runs the same commands with this machine's Python, no wheels: `sluice model
# import` of the shipped tiny policy, then the `default` job, async and --sync, each to
# its first training step (trainer.total_steps=1), then the table.
#
# Settings (environment): SLUICE_DEVICE_STATE (staging and runs; /tmp/sluice-device, or
# /tmp/sluice-device-cpu with --cpu), SLUICE_DEVICE_MINUTES (2), SLUICE_DEVICE_RUNS
# ("async sync"), SLUICE_DEVICE_CONFIG and SLUICE_DEVICE_MODEL (the config and the model
# source: reasoning_gym and the GGUF; --cpu: default and the shipped policy),
# SLUICE_DEVICE_SET (more KEY=VALUE overrides, space-separated), SLUICE_DEVICE_SMOKE=1
# (a call whose GGUF is not complete yet runs the tiny job on CUDA to its first step),
# SLUICE_DEVICE_CALL (the call's number, for the log), SLUICE_DEVICE_PYTHON (python3).
set -euo pipefail

MODE=gpu
if [[ "${1:-}" == "--cpu" ]]; then MODE=cpu; fi
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PY="${SLUICE_DEVICE_PYTHON:-python3}"
if [[ $MODE == cpu ]]; then STATE="${SLUICE_DEVICE_STATE:-/tmp/sluice-device-cpu}"; else STATE="${SLUICE_DEVICE_STATE:-/tmp/sluice-device}"; fi
OUT="${OUT:-$STATE/out}"
MINUTES="${SLUICE_DEVICE_MINUTES:-2}"
RUNS="${SLUICE_DEVICE_RUNS:-async sync}"
CALL="${SLUICE_DEVICE_CALL:-?}"
LOGS="$STATE/logs"
mkdir -p "$STATE" "$OUT" "$LOGS"
rm -f "$OUT/device.log" "$OUT/summary.md" "$OUT/logs.tar.gz"
exec > >(tee -a "$OUT/device.log") 2>&1

export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export DO_NOT_TRACK=true MLFLOW_DISABLE_TELEMETRY=true PREFECT_SERVER_ANALYTICS_ENABLED=false
export PREFECT_HOME="${PREFECT_HOME:-$STATE/prefect-home}"
if [[ $MODE == gpu ]]; then
    export PYTHONPATH="$REPO/src:$STATE/site${PYTHONPATH:+:$PYTHONPATH}"
    # Roles are forked from a launcher that imported torch: asking whether CUDA is there
    # through NVML leaves the driver uninitialised, so a forked child can still use it.
    export PYTORCH_NVML_BASED_CUDA_CHECK=1
else
    export PYTHONPATH="$REPO/src:$REPO${PYTHONPATH:+:$PYTHONPATH}"
fi

STARTED=$(date +%s.%N)
PHASE=""
PHASE_AT=$STARTED
: >"$STATE/phases.txt"
seconds_since() { awk -v a="$1" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'; }
phase() {  # phase NAME: ends the phase before (its seconds on record), starts NAME
    if [[ -n $PHASE ]]; then
        echo "[phase $PHASE] $(seconds_since "$PHASE_AT") s"
        echo "| $PHASE | $(seconds_since "$PHASE_AT") |" >>"$STATE/phases.txt"
    fi
    PHASE="$1"
    PHASE_AT=$(date +%s.%N)
    [[ -n $PHASE ]] && echo "== $PHASE (t+$(seconds_since "$STARTED") s)"
    return 0
}
finish() {  # on every exit: the last phase's time, the logs packed into $OUT
    local status=$? items=()
    phase ""
    mapfile -t items < <(cd "$STATE" && ls -d logs phases.txt gpu-*.txt runs/*/exit.txt \
        runs/*/.sluice/runs/*/logs runs/*/.sluice/runs/*/_status \
        runs/*/.sluice/runs/*/config.json runs/*/.sluice/runs/*/metrics.jsonl 2>/dev/null)
    tar -czf "$OUT/logs.tar.gz" --ignore-failed-read -C "$STATE" "${items[@]}" 2>/dev/null || true
    echo "device run: exit $status after $(seconds_since "$STARTED") s (call $CALL, $MODE); files in $OUT"
}
trap finish EXIT
fail() { echo "DEVICE RUN FAILED: $*"; exit 1; }

echo "device run: $MODE, call $CALL, repo $REPO, state $STATE, $(date -u +%FT%TZ)"

# ---------------------------------------------------------------- stage, install, check
if [[ $MODE == gpu ]]; then
    phase stage
    set +e
    timeout 180 "$PY" "$REPO/tests/gpu/device_stage.py" --state "$STATE" --repo "$REPO"
    staged=$?
    set -e
    case $staged in
        0 | 3) ;;
        4) fail "the wheels of call 1 are not staged here: the machine did not stay warm since call 1 (or call 1 never ran); run the plan again from call 1" ;;
        *) fail "staging stopped (exit $staged): see the stage: lines above" ;;
    esac
    bundle=$("$PY" -c "import json; print(json.load(open('$STATE/manifest.json'))['id'])")
    if [[ ! -f "$STATE/site/.installed-$bundle" ]]; then
        phase install
        rm -rf "$STATE/site"
        timeout 300 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
            --upgrade --target "$STATE/site" "$STATE"/wheels/*.whl >"$LOGS/pip-install.log" 2>&1 \
            || { tail -n 20 "$LOGS/pip-install.log"; fail "pip install of the carried wheels failed"; }
        echo "installed the carried wheels into $STATE/site"
        phase check
        checked=0
        timeout 120 "$PY" "$REPO/tests/gpu/device_deps.py" installed --fixable-to "$STATE/fixable.txt" \
            || checked=$?
        if [[ -s "$STATE/fixable.txt" ]]; then
            fallbacks=()
            while read -r wheel; do fallbacks+=("$STATE/fallbacks/$wheel"); done <"$STATE/fixable.txt"
            echo "installing fallback wheels over the machine's own releases: ${fallbacks[*]##*/}"
            timeout 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
                --upgrade --target "$STATE/site" "${fallbacks[@]}" >>"$LOGS/pip-install.log" 2>&1 \
                || fail "pip install of the fallback wheels failed"
            checked=0
            timeout 120 "$PY" "$REPO/tests/gpu/device_deps.py" installed || checked=$?
        fi
        [[ $checked == 0 ]] || fail "a distribution Sluice needs is missing on this machine (device deps: lines above)"
        touch "$STATE/site/.installed-$bundle"
    fi
    phase imports
    timeout 180 "$PY" - <<'EOF' || fail "an import failed (traceback above)"
import importlib.metadata as md, platform, sys
import mlflow, prefect, pydantic, reasoning_gym, gguf, math_verify, sqlalchemy, alembic  # noqa
import sluice.flows.cli, sluice.flows.train, sluice.flows.train_sync, sluice.tasks.run.report  # noqa
import torch, transformers
assert torch.cuda.is_available(), "torch sees no CUDA device"
print(f"python {platform.python_version()} ({sys.executable}); torch {torch.__version__} on "
      f"{torch.cuda.get_device_name(0)}; transformers {transformers.__version__}; prefect "
      f"{prefect.__version__}; mlflow-skinny {md.version('mlflow-skinny')}; pydantic {pydantic.__version__}")
EOF
    nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv || true
else
    staged=0
fi

# ---------------------------------------------------------------- the runs
gpu_sampler() {  # one line a second: epoch, MiB used on the GPU, then pid,MiB;pid,MiB
    while :; do
        echo "$(date +%s) $(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -n 1) $(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits | tr -d ' ' | tr '\n' ';')"
        sleep 1
    done
}

import_model() {  # import_model SRC DIR: `sluice model import`, skipped when done already
    local source="$1" target="$2"
    if [[ -f "$target.imported" && "$(cat "$target.imported")" == "$source" ]]; then
        echo "model: $target already imported from $source"
        return 0
    fi
    rm -f "$target.imported"
    timeout 300 "$PY" -m sluice.flows.cli model import "$source" "$target" --force \
        >"$LOGS/import.log" 2>&1 || { tail -n 20 "$LOGS/import.log"; fail "sluice model import $source failed"; }
    tail -n 1 "$LOGS/import.log"
    echo "$source" >"$target.imported"
    "$PY" - "$target" <<'EOF'
import json, sys
from pathlib import Path
d = Path(sys.argv[1])
t, g = (json.loads((d / n).read_text()) for n in ("tokenizer_config.json", "generation_config.json"))
print(f"model: eos_token {t.get('eos_token')!r}, pad_token {t.get('pad_token')!r}; "
      f"generation eos_token_id {g.get('eos_token_id')}; written by transformers {g.get('transformers_version')}")
EOF
}

FAILED_RUNS=()
train() {  # train LABEL CONFIG MODEL_DIR DEVICE SECONDS [KEY=VALUE ...]: one `sluice train`
    local label="$1" config="$2" model="$3" device="$4" limit="$5"
    shift 5
    local dir="$STATE/runs/$label" sampler="" rc=0 args=() at
    local sync=()
    [[ $label == sync* ]] && sync=(--sync)
    for item in "$@" ${SLUICE_DEVICE_SET:-}; do args+=(--set "$item"); done
    rm -rf "$dir" "$STATE/gpu-$label.txt"
    mkdir -p "$dir"
    if [[ $device == cuda ]]; then
        gpu_sampler >"$STATE/gpu-$label.txt" 2>/dev/null &
        sampler=$!
    fi
    echo "\$ sluice train $config ${sync[*]} --set model.path=$model --set device=$device ${args[*]}"
    at=$(date +%s.%N)
    # --foreground: the SIGTERM goes to `sluice train` alone, which stops its roles itself.
    (cd "$dir" && timeout --foreground -k 30 "$limit" "$PY" -m sluice.flows.cli train "$config" "${sync[@]}" \
        --set "model.path=$model" --set "device=$device" "${args[@]}") >"$LOGS/train-$label.log" 2>&1 || rc=$?
    [[ -n $sampler ]] && { kill "$sampler" 2>/dev/null || true; wait "$sampler" 2>/dev/null || true; }
    echo "$rc ($(seconds_since "$at") s)" >"$dir/exit.txt"
    grep -E "Flow run .* - step |Done\.|held out reward|sluice: error|Error|Traceback" "$LOGS/train-$label.log" | tail -n 12 || true
    case $rc in
        0) echo "run $label: finished" ;;
        124 | 137 | 143) echo "run $label: stopped at its limit of ${limit} s (exit $rc: SIGTERM, then SIGKILL 30 s later if still running); what it recorded stands" ;;
        *) echo "run $label: FAILED (exit $rc); the log's end:"; tail -n 30 "$LOGS/train-$label.log"; FAILED_RUNS+=("$label") ;;
    esac
}

report() {  # report TITLE LABEL...: the table, on stdout and into summary.md
    local title="$1" runs=() gpus=()
    shift
    for label in "$@"; do
        runs+=(--run "$label=$STATE/runs/$label")
        [[ -f "$STATE/gpu-$label.txt" ]] && gpus+=(--gpu "$label=$STATE/gpu-$label.txt")
    done
    timeout 180 "$PY" "$REPO/tests/gpu/device_report.py" --title "$title" "${runs[@]}" "${gpus[@]}" \
        | tee "$OUT/summary.md" || echo "the report failed (above); the logs are in logs.tar.gz"
}

if [[ $MODE == gpu && $staged == 3 ]]; then
    if [[ "${SLUICE_DEVICE_SMOKE:-0}" == 1 ]]; then
        phase smoke
        import_model "$REPO/engines/policy/policies/longtail_sum-llama-0.9m" "$STATE/model-tiny"
        train smoke-async default "$STATE/model-tiny" cuda 240 trainer.total_steps=1
        report "# Smoke: the tiny default job on CUDA to its first step (call $CALL)" smoke-async
    fi
    phase ""
    echo "STAGED: call $CALL done; the GGUF is not complete yet (stage: lines above): run the next call of the plan within 30 s"
    [[ ${#FAILED_RUNS[@]} -eq 0 ]] || fail "the smoke run failed: ${FAILED_RUNS[*]}"
    exit 0
fi

if [[ $MODE == gpu ]]; then
    CONFIG="${SLUICE_DEVICE_CONFIG:-reasoning_gym}"
    SOURCE="${SLUICE_DEVICE_MODEL:-$STATE/$("$PY" -c "import json; print(json.load(open('$STATE/manifest.json'))['gguf']['file'])")}"
    DEVICE=cuda
    BUDGET=$(awk -v m="$MINUTES" 'BEGIN { printf "%d", m * 60 }')
    LIMIT=$((BUDGET + 150))
    SETS=("trainer.time_budget_s=$BUDGET")
else
    CONFIG="${SLUICE_DEVICE_CONFIG:-default}"
    SOURCE="${SLUICE_DEVICE_MODEL:-$REPO/engines/policy/policies/longtail_sum-llama-0.9m}"
    DEVICE=cpu
    LIMIT=400
    SETS=("trainer.total_steps=1")
fi
phase import
import_model "$SOURCE" "$STATE/model-$CONFIG"
for run in $RUNS; do
    phase "train-$run"
    train "$run" "$CONFIG" "$STATE/model-$CONFIG" "$DEVICE" "$LIMIT" "${SETS[@]}"
done
phase report
report "# sluice train $CONFIG on $DEVICE: ${SETS[*]} (call $CALL, $(date -u +%FT%TZ))" $RUNS
phase ""
{
    echo
    echo "| phase | seconds |"
    echo "|---|---|"
    cat "$STATE/phases.txt"
} | tee -a "$OUT/summary.md"
[[ ${#FAILED_RUNS[@]} -eq 0 ]] || fail "run(s) failed: ${FAILED_RUNS[*]}"
echo "DONE: the table is in summary.md"
