#!/usr/bin/env bash
# Runs the command lines the README shows for training (its Training section, its Hugging Face
# section, the chat workflow, LoRA, evaluation, packing, generation, plotting a run, planning and profiling)
# against a tiny model and tokenizer, so that they stay true.
# Every /models/NAME is a 2-layer Llama carrying the qwen2 test tokenizer (with its chat
# template); `strata train` lines get short-run overrides appended (a few steps of short
# sequences), nothing else is changed. Usage: readme_examples.sh SOURCE_DIR BINARY_DIR
set -euo pipefail
src=$(cd "$1" && pwd)
strata=$(cd "$2" && pwd)/strata
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"

# The sh and yaml blocks under the README's headings named here, continuation lines joined.
blocks() {  # LANG HEADING...
  local lang=$1
  shift
  awk -v lang="$lang" -v wanted="$(printf '%s\n' "$@")" '
    BEGIN { n = split(wanted, w, "\n"); for (i = 1; i <= n; ++i) want[w[i]] = 1 }
    /^##+ / { h = $0; sub(/^##+ /, "", h); on = (h in want) }
    /^```/ { if (inside) { inside = 0; next } if (on && $0 == "```" lang) { inside = 1; next } }
    inside {
      line = $0
      if (lang == "sh") {
        if (line ~ /\\$/) { sub(/\\$/, "", line); pending = pending line; next }
        line = pending line; pending = ""
      }
      print line
    }' "$src/README.md"
}

# A tiny model and tokenizer wherever the README names one.
fixture="$src/tests/fixtures/tokenizer/qwen2"
"$strata" train model.preset=tiny 'model.set=[vocab_size=640,num_hidden_layers=2,hidden_size=64,intermediate_size=96]' \
  train.steps=1 optim.warmup_steps=0 train.micro_batch=1 train.seq_len=32 run.dir=make-model \
  run.export=tiny-model run.log_level=warn > make-model.log 2>&1 || { cat make-model.log; exit 1; }
for name in $(grep -o '/models/[A-Za-z0-9._-]*' "$src/README.md" | sort -u | sed 's|/models/||'); do
  mkdir -p models
  cp -r tiny-model "models/$name"
  cp "$fixture/tokenizer.json" "$fixture/tokenizer_config.json" "models/$name/"
done
# The inputs the lines read: a text corpus and chats (their lines tokenize them).
for i in $(seq 1 300); do
  printf '{"text": "line %d: the quick brown fox jumps over the lazy dog, %d times."}\n' "$i" $((i % 7))
done > corpus.jsonl
for i in $(seq 1 60); do
  printf '{"messages": [{"role": "user", "content": "What is %d plus %d?"}, {"role": "assistant", "content": "%d plus %d is %d."}]}\n' \
    "$i" "$i" "$i" "$i" $((2 * i))
done > chats.jsonl
head -n 20 chats.jsonl > chats-held-out.jsonl
echo '[{"role": "user", "content": "What is 2 plus 2?"}]' > question.json
blocks yaml "Training" | sed "s|/models/|$work/models/|g" > run.yaml
grep -q "model:" run.yaml || { echo "readme_examples: no yaml block under Training"; exit 1; }

short="train.steps=3 optim.warmup_steps=1 train.seq_len=32 train.micro_batch=2 train.grad_accum=1"
count=0
while IFS= read -r line; do
  line=${line%%  #*}  # the README's trailing comments
  [[ $line =~ ^\./build/strata ]] || continue
  cmd=${line/.\/build\/strata/\"$strata\"}
  cmd=${cmd//\/models\//$work/models/}
  if [[ $line =~ ^\./build/strata\ train && ! $line =~ --help && ! $line =~ --print-config ]]; then
    cmd="$cmd $short"
  fi
  echo "readme_examples: $line"
  if ! out=$(eval "$cmd" 2>&1 </dev/null); then
    echo "$out" | tail -20
    echo "readme_examples: FAILED: $line"
    exit 1
  fi
  count=$((count + 1))
done < <(for section in "Hugging Face models, tokenizers and data" "Training" "Fine-tuning on chat data, end to end" "LoRA" "Evaluation" "Packing" "Generate" "Plots" \
                          "Will it fit, and how fast?" "Plan, profile, plot: one example"; do
           blocks sh "$section"  # the data section first: it tokenizes what Training's run.yaml reads
         done)
((count >= 8)) || { echo "readme_examples: only $count command lines found; the README's sections moved?"; exit 1; }
for out in out/hf out/qwen2-chat; do
  [[ -f $out/config.json && -f $out/tokenizer.json ]] || { echo "readme_examples: $out is not a Hugging Face export"; exit 1; }
done
echo "readme_examples: $count command lines ran"
