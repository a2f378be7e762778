#!/usr/bin/env bash
# The instructions the layer adds per request (issue 23 §2), counted as BENCHMARKS.md says:
# the layer bench under callgrind, one scenario per run, at 2 000 and 4 000 requests; per request
# is the difference halved over 2 000 (start-up cancels out), SHA-256 left out (valgrind runs it
# in software, where the CPU has instructions for it). The layer's rows are counted against the
# bare router sent the same keys.
#
#   bash suite/benches/instructions.sh          builds the layer bench, then counts
#   bash suite/benches/instructions.sh BINARY   counts with a layer bench already built
#
# Needs valgrind (Debian: `apt-get install valgrind`). About a minute.
set -euo pipefail

if ! command -v valgrind > /dev/null || ! command -v callgrind_annotate > /dev/null; then
  echo "instructions.sh: needs valgrind and callgrind_annotate (apt-get install valgrind)" >&2
  exit 2
fi

bin=${1:-}
if [[ -z $bin ]]; then
  cd "$(dirname "$0")/../.."
  bin=$(cargo bench -p suite --bench layer --no-run 2>&1 \
    | sed -n 's/.*Executable .*(\(.*deps\/layer-[0-9a-f]*\)).*/\1/p' | tail -1)
  if [[ -z $bin ]]; then
    echo "instructions.sh: could not build the layer bench" >&2
    exit 1
  fi
fi

out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

# Instructions of one run, SHA-256's compression function left out.
count() {
  local scenario=$1 requests=$2 file="$out/$1.$2.out"
  BENCH_ONLY=$scenario BENCH_REQUESTS=$requests \
    valgrind --tool=callgrind --callgrind-out-file="$file" "$bin" > /dev/null 2>&1
  callgrind_annotate --auto=no --threshold=100 "$file" 2> /dev/null | awk '
    { n = $1; gsub(",", "", n) }
    /PROGRAM TOTALS/ { total = n }
    /sha2::sha256::compress256|sha2::sha256::x86::/ { sha += n }
    END { printf "%d\n", total - sha }'
}

# Instructions per request of one scenario.
per_request() {
  local small large
  small=$(count "$1" 2000)
  large=$(count "$1" 4000)
  echo $(((large - small) / 2000))
}

declare -A per
for scenario in bare-unique unique bare-same replay floor-unique floor-replay; do
  per[$scenario]=$(per_request "$scenario")
done

unique=$((per[unique] - per[bare-unique]))
replay=$((per[replay] - per[bare-same]))
floor_unique=$((per[floor-unique] - per[bare-unique]))
floor_replay=$((per[floor-replay] - per[bare-same]))

printf '%-44s %12s %10s\n' "per request, SHA-256 left out" instructions added
printf '%-44s %12d %10s\n' "bare router, unique keys sent" "${per[bare-unique]}" ""
printf '%-44s %12d %+10d\n' "layer + MemoryStore, unique keys" "${per[unique]}" "$unique"
printf '%-44s %12d %+10d\n' "floor, unique keys" "${per[floor-unique]}" "$floor_unique"
printf '%-44s %12d %10s\n' "bare router, one key sent" "${per[bare-same]}" ""
printf '%-44s %12d %+10d\n' "layer + MemoryStore, replays" "${per[replay]}" "$replay"
printf '%-44s %12d %+10d\n' "floor, replays" "${per[floor-replay]}" "$floor_replay"
echo

# Half of what the layer added on 2026-12-02 (issue 23 §2).
verdict() { if (($1 <= $2)); then echo met; else echo missed; fi; }
echo "target (issue 23 §2): a unique-key request adds at most +9905: +$unique, $(verdict "$unique" 9905)"
echo "target (issue 23 §2): a replay adds at most +4048: +$replay, $(verdict "$replay" 4048)"
