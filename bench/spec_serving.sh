#!/usr/bin/env bash
# `bench serving` through the gateway, speculation off and on: two workers of SmolLM2 in one local stack
# (`smol-plain`, and `smol-spec` with n-gram k=3), measured in alternating rounds so that both see the same
# machine, on the quote-heavy prompts of bench spec. Usage: bench/spec_serving.sh [output folder]; each round
# writes <model>-<round>.json there (by default a new temporary folder, printed).
set -u
cd "$(dirname "$0")/.."
OUT=${1:-$(mktemp -d -t spec-serving.XXXXXX)}
mkdir -p "$OUT"
echo "rounds in $OUT"
TF=${TOKENFLEET:-.venv/bin/tokenfleet}
$TF up --port 8011 > "$OUT/up.log" 2>&1 &
UP=$!
for i in $(seq 1 120); do grep -q "tokenfleet is up" "$OUT/up.log" && break; sleep 1; done
REDIS=$(grep -o "Redis [^)]*" "$OUT/up.log" | head -1 | cut -d' ' -f2)
KEY=$(cat ~/.cache/tokenfleet/dev-key)
echo "redis=$REDIS"
REDIS_URL=$REDIS $TF worker --model smollm2-135m-instruct --served-model-name smol-plain --metrics-port -1 > "$OUT/worker-plain.log" 2>&1 &
P1=$!
REDIS_URL=$REDIS $TF worker --model smollm2-135m-instruct --served-model-name smol-spec --metrics-port -1 \
  --speculative-config '{"method": "ngram", "num_speculative_tokens": 3}' > "$OUT/worker-spec.log" 2>&1 &
P2=$!
for i in $(seq 1 180); do
  n=$(curl -s -H "Authorization: Bearer $KEY" http://127.0.0.1:8011/v1/models | grep -o 'smol-[a-z]*' | sort -u | wc -l)
  [ "$n" -ge 2 ] && break; sleep 1
done
echo "models ready after $i s"
for r in 1 2 3; do
  for m in $( [ $((r % 2)) -eq 1 ] && echo "smol-plain smol-spec" || echo "smol-spec smol-plain" ); do
    $TF bench serving --base-url http://127.0.0.1:8011/v1 --api-key "$KEY" --model $m --request-rate 0.5 \
      --num-prompts 16 --prompt-file bench/data/spec_prompts.json:quote --output-len 128 --warmup 2 --seed $r --json "$OUT/$m-$r.json" > "$OUT/$m-$r.log" 2>&1
    echo "round $r $m rc=$?"
  done
done
kill $P1 $P2; wait $P1 $P2 2>/dev/null
kill $UP; wait $UP 2>/dev/null
echo done
