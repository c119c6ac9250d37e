#!/usr/bin/env bash
# curl against a running llmserve (OpenAI-compatible API). Start one first, e.g.:
#   llmserve --config configs/example-plugin.yaml
# Usage: examples/clients/curl.sh [BASE_URL]   (default http://127.0.0.1:8000)
# With server.api_key set, export LLMSERVE_API_KEY=... and the lines below send it.
set -euo pipefail
BASE="${1:-http://127.0.0.1:8000}"
AUTH=(-H "Authorization: Bearer ${LLMSERVE_API_KEY:-not-needed}")
MODEL="$(curl -sS "${AUTH[@]}" "$BASE/v1/models" | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')"
echo "model: $MODEL"

echo "--- health"
curl -sS "$BASE/health"; echo

echo "--- completion"
curl -sS "${AUTH[@]}" "$BASE/v1/completions" -H "Content-Type: application/json" \
  -d "{\"model\": \"$MODEL\", \"prompt\": \"The capital of France is\", \"max_tokens\": 16, \"temperature\": 0}"
echo

echo "--- chat completion"
curl -sS "${AUTH[@]}" "$BASE/v1/chat/completions" -H "Content-Type: application/json" \
  -d "{\"model\": \"$MODEL\", \"messages\": [{\"role\": \"user\", \"content\": \"Name three prime numbers.\"}], \"max_tokens\": 16}"
echo

echo "--- streamed completion (server-sent events; -N turns off curl's buffering)"
curl -sS -N "${AUTH[@]}" "$BASE/v1/completions" -H "Content-Type: application/json" \
  -d "{\"model\": \"$MODEL\", \"prompt\": \"Once upon a time\", \"max_tokens\": 8, \"stream\": true}"

echo "--- a bad request gets an OpenAI-shaped error body"
curl -sS "${AUTH[@]}" "$BASE/v1/completions" -H "Content-Type: application/json" \
  -d "{\"model\": \"$MODEL\", \"prompt\": \"hi\", \"max_tokens\": -1}"
echo

echo "--- engine state (queue, cache, latency percentiles)"
curl -sS "${AUTH[@]}" "$BASE/stats"; echo
