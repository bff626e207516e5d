#!/bin/sh
# pdserve verify on good and damaged checkpoints made by
#   pdserve mkmodel --preset tiny --seed 4 [--shard-size 0.01]
# (a flipped byte, a truncated shard, a missing shard, a wrong manifest
# entry, header/config mismatches, every malformed case of corrupt.py), and
# replicas refusing to start with --verify-checkpoint. Each failure must exit
# 1 with a message naming the file (and the tensor); good ones exit 0.
set -u
BIN=${PD_BIN:-build/pdserve}
SRC=${PD_SOURCE_DIR:-.}
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
fail=0
"$BIN" mkmodel --preset tiny --seed 4 --out "$T/one" >/dev/null 2>&1 || { echo "mkmodel failed"; exit 1; }
"$BIN" mkmodel --preset tiny --seed 4 --out "$T/shard" --shard-size 0.01 >/dev/null 2>&1 || { echo "mkmodel failed"; exit 1; }
[ -f "$T/shard/model-00002-of-00003.safetensors" ] || { echo "mkmodel --shard-size 0.01 made no 3 shards"; exit 1; }

# check NAME WANT_RC WORDS... -- ARGS...: runs pdserve ARGS, wants exit WANT_RC
# and every word in stdout+stderr
check() {
    name=$1 want=$2
    shift 2
    words=""
    while [ "$1" != "--" ]; do words="$words
$1"; shift; done
    shift
    "$BIN" "$@" >"$T/out" 2>&1
    rc=$?
    if [ $rc -ne "$want" ]; then
        echo "FAIL $name: exit $rc, want $want:"; sed 's/^/    /' "$T/out"; fail=1; return
    fi
    missing=0
    IFS='
'
    for w in $words; do
        grep -qF -- "$w" "$T/out" || { echo "FAIL $name: output lacks '$w':"; sed 's/^/    /' "$T/out"; missing=1; fail=1; }
    done
    unset IFS
    [ $missing -eq 0 ] && echo "ok   $name (exit $rc): $(grep -v '^verify: read\|^verify: hashed' "$T/out" | head -1)"
}

fresh() { rm -rf "$T/m"; cp -r "$T/$1" "$T/m"; }

# ---- good -------------------------------------------------------------------
check good_single 0 "verify: OK" "wrote $T/one.json" "MB/s" -- verify --model "$T/one" --write-manifest "$T/one.json"
check good_single_manifest 0 "all match $T/one.json" -- verify --model "$T/one" --manifest "$T/one.json" --jobs 2
check good_sharded 0 "3 shards" "wrote" -- verify --model "$T/shard" --write-manifest "$T/shard.json" --jobs 3
check good_sharded_manifest 0 "all match" -- verify --model "$T/shard" --manifest "$T/shard.json"
check good_no_hash 0 "not hashed" -- verify --model "$T/shard" --no-hash
check usage_no_model 2 "--model DIR is required" -- verify
check usage_no_hash_manifest 2 "--no-hash excludes" -- verify --model "$T/one" --no-hash --manifest "$T/one.json"

# ---- a flipped byte in tensor data: only the digest can tell -------------------
fresh one
python3 -c "
import os, sys
p = sys.argv[1]; f = open(p, 'r+b'); f.seek(os.path.getsize(p) - 4096); b = f.read(1)
f.seek(-1, 1); f.write(bytes([b[0] ^ 0x10]))" "$T/m/model.safetensors"
check flipped_byte_structure 0 "verify: OK" -- verify --model "$T/m"
check flipped_byte 1 "model.safetensors: SHA-256" "differs from the manifest" "FAILED" -- \
    verify --model "$T/m" --manifest "$T/one.json"

# ---- a truncated shard --------------------------------------------------------
fresh shard
python3 -c "
import os, sys
p = sys.argv[1]; os.truncate(p, os.path.getsize(p) - 1000)" "$T/m/model-00003-of-00003.safetensors"
check truncated_shard 1 "model-00003-of-00003.safetensors: truncated" "1000 bytes missing" "tensor 'lm_head.weight'" -- \
    verify --model "$T/m"
check truncated_shard_manifest 1 "model-00003-of-00003.safetensors: " "the manifest says" -- \
    verify --model "$T/m" --manifest "$T/shard.json"

# ---- a missing shard ------------------------------------------------------------
fresh shard
rm "$T/m/model-00002-of-00003.safetensors"
check missing_shard 1 "model-00002-of-00003.safetensors: missing shard" "model.safetensors.index.json maps" -- \
    verify --model "$T/m"
check missing_shard_manifest 1 "model-00002-of-00003.safetensors: missing (listed in the manifest" -- \
    verify --model "$T/m" --manifest "$T/shard.json"

# ---- a wrong manifest entry, a manifest that is not one ------------------------
python3 -c "
import json, sys
m = json.load(open(sys.argv[1])); m['config.json']['sha256'] = 'ab' * 32
json.dump(m, open(sys.argv[2], 'w'))" "$T/one.json" "$T/wrong.json"
check wrong_manifest_entry 1 "config.json: SHA-256" "differs from the manifest's abab" -- \
    verify --model "$T/one" --manifest "$T/wrong.json"
echo '{"config.json": {"size": 3}}' >"$T/bad.json"
check malformed_manifest 1 "entry 'config.json' is not" "model.safetensors: not listed in the manifest" -- \
    verify --model "$T/one" --manifest "$T/bad.json"
check missing_manifest 1 "$T/nope.json: cannot read the manifest" -- verify --model "$T/one" --manifest "$T/nope.json"
fresh one
check manifest_not_written 1 "not written" -- verify --model "$T/m" --manifest "$T/wrong.json" --write-manifest "$T/w.json"
[ -e "$T/w.json" ] && { echo "FAIL manifest_not_written: $T/w.json exists"; fail=1; }

# ---- header / config mismatches ---------------------------------------------------
fresh one
python3 -c "
import json, sys
c = json.load(open(sys.argv[1])); c['num_hidden_layers'] += 1; json.dump(c, open(sys.argv[1], 'w'))" "$T/m/config.json"
check config_more_layers 1 "missing tensor 'model.layers.3.input_layernorm.weight', which config.json implies" -- \
    verify --model "$T/m" --no-hash
fresh one
python3 -c "
import json, sys
c = json.load(open(sys.argv[1])); c['num_hidden_layers'] -= 1; json.dump(c, open(sys.argv[1], 'w'))" "$T/m/config.json"
check config_fewer_layers 0 "note: model.safetensors:" "tensors config.json does not imply" -- verify --model "$T/m" --no-hash

# every malformed checkpoint of the loader's test: verify fails too, naming the same things
for case in truncated header_past_end header_short malformed_json not_object overlap out_of_range \
            span_mismatch unknown_dtype missing_tensor shape_mismatch duplicate_name \
            config_missing_field config_bad_type config_bad_model_type config_malformed empty_file \
            missing_scale; do
    fresh one
    expect=$(python3 "$SRC/tests/cli/corrupt.py" "$T/m" "$case") || { echo "corrupt.py $case failed"; fail=1; continue; }
    set -f
    # shellcheck disable=SC2086
    check "corrupt_$case" 1 $expect -- verify --model "$T/m" --no-hash
    set +f
done

# ---- replicas: --verify-checkpoint refuses to start, or starts after it ----------
fresh shard
rm "$T/m/model-00002-of-00003.safetensors"
for svc in decode prefill; do
    check "${svc}_refuses" 1 "refusing to start" "model-00002-of-00003.safetensors: missing shard" -- \
        $svc --model "$T/m" --verify-checkpoint --gateway tcp://127.0.0.1:9 --num-kv-blocks 16
done
check decode_refuses_manifest 1 "refusing to start" "config.json: SHA-256" -- \
    decode --model "$T/one" --checkpoint-manifest "$T/wrong.json" --gateway tcp://127.0.0.1:9 --num-kv-blocks 16

# a good one starts: wait for the start-up summary, then stop it
"$BIN" decode --model "$T/one" --verify-checkpoint --checkpoint-manifest "$T/one.json" \
    --gateway tcp://127.0.0.1:9 --num-kv-blocks 16 >"$T/dec.log" 2>&1 &
pid=$!
i=0
while [ $i -lt 300 ] && ! grep -q "total to registration" "$T/dec.log"; do sleep 0.1; i=$((i + 1)); done
kill "$pid" 2>/dev/null
wait "$pid" 2>/dev/null
for w in "checkpoint $T/one verified" "files match $T/one.json" "start-up: verify checkpoint" \
         "start-up: load weights" "start-up: allocate KV" "total to registration"; do
    grep -qF "$w" "$T/dec.log" || { echo "FAIL decode_verified: log lacks '$w':"; cat "$T/dec.log"; fail=1; }
done
[ $fail -eq 0 ] && echo "ok   decode_verified: $(grep -F verified "$T/dec.log" | head -1)"
exit $fail
