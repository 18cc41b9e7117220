#!/usr/bin/env bash
# Server side of the lm-eval comparison (see bench/lm_eval/README.md): start `python -m jax_offload.serve` on the
# default model in float32, run lm-eval --model local-completions on both local tasks against it, stop the server,
# compare with the --model hf run in bench/results/lm_eval/hf (bench/results/lm_eval/compare.md).
# Env: MODEL (default: python -m jax_offload.default_model), PORT (8765), NUM_CONCURRENT (1), PYTHON (the
# project's, default .venv/bin/python), LMEVAL_VENV (/work/lmeval-venv; created if missing), HF=1 to redo the hf run,
# RUN (server: output in bench/results/lm_eval/$RUN, report compare.md; any other name: compare_$RUN.md).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}; [ -x "$PY" ] || PY=python3
VENV=${LMEVAL_VENV:-/work/lmeval-venv}
MODEL=${MODEL:-$("$PY" -m jax_offload.default_model)}
PORT=${PORT:-8765}
NAME=SmolLM2-135M-Instruct
OUT=bench/results/lm_eval
TASKS=jo_facts_mc,jo_short_gen
RUN=${RUN:-server}
REPORT=$OUT/compare.md; [ "$RUN" = server ] || REPORT=$OUT/compare_$RUN.md
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

if [ ! -x "$VENV/bin/lm_eval" ]; then  # torch: a CPU wheel is enough (pip's default torch wheel pulls CUDA libraries)
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q "lm-eval[hf,api]==0.4.13" "transformers==5.24.0" "torch==2.13.0"
fi
if [ "${HF:-0}" = 1 ]; then
    rm -rf "$OUT/hf"
    "$VENV/bin/lm_eval" --model hf --model_args "pretrained=$MODEL,dtype=float32" --tasks $TASKS \
        --include_path bench/lm_eval/tasks --device cpu --batch_size 1 --log_samples --output_path "$OUT/hf"
fi

mkdir -p "$OUT"
# --no-warm-up: the warm-up compiles every batch size and prompt length, which took over 10 minutes on the 2-core
# CPU machine; lm-eval's requests compile what they use (the answers are the same either way).
"$PY" -m jax_offload.serve --model "$MODEL" --dtype float32 --port "$PORT" --served-model-name "$NAME" --no-warm-up \
    > "$OUT/$RUN.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break
    if ! kill -0 $SERVER 2> /dev/null; then echo "server exited:"; tail -40 "$OUT/$RUN.log"; exit 1; fi
    sleep 1
done
curl -sf "http://127.0.0.1:$PORT/health" > /dev/null || { echo "no /health after 600 s"; exit 1; }

rm -rf "${OUT:?}/$RUN"
"$VENV/bin/lm_eval" --model local-completions \
    --model_args "model=$NAME,base_url=http://127.0.0.1:$PORT/v1/completions,tokenizer=$MODEL,tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=${NUM_CONCURRENT:-1},max_retries=1,timeout=600" \
    --tasks $TASKS --include_path bench/lm_eval/tasks --batch_size 1 --log_samples --output_path "$OUT/$RUN"
kill $SERVER; wait $SERVER 2> /dev/null || true
[ -s "$OUT/$RUN.log" ] || rm -f "$OUT/$RUN.log"
find "$OUT" -name 'samples_*.jsonl' -size +200k -exec gzip -f {} +
python3 bench/lm_eval/compare.py "$OUT/hf" "$OUT/$RUN" --out "$REPORT"
