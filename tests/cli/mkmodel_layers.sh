#!/bin/sh
# pdserve mkmodel --num-layers N: the preset's shapes with N layers (config
# and tensors agree, the model runs); bad values exit 2 naming the flag.
set -u
BIN=${PD_BIN:-build/pdserve}
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
fail=0
"$BIN" mkmodel --preset tiny --seed 3 --num-layers 2 --out "$T/m2" >/dev/null 2>&1 || { echo "FAIL: mkmodel --num-layers 2"; exit 1; }
n=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['num_hidden_layers'])" "$T/m2/config.json")
[ "$n" = 2 ] || { echo "FAIL: config num_hidden_layers $n, want 2"; fail=1; }
# tensors of layer 2 must not exist, those of layer 1 must
python3 - "$T/m2" <<'PY' || fail=1
import json, struct, sys, glob
names = set()
for f in glob.glob(sys.argv[1] + "/*.safetensors"):
    with open(f, "rb") as fh:
        n = struct.unpack("<Q", fh.read(8))[0]
        names |= set(json.loads(fh.read(n)))
if any(k.startswith("model.layers.2.") for k in names) or not any(k.startswith("model.layers.1.") for k in names):
    print("FAIL: tensors do not match 2 layers"); sys.exit(1)
PY
"$BIN" generate --model "$T/m2" --prompt-ids 1,2,3 -n 4 --ids >/dev/null 2>"$T/err" || { echo "FAIL: the cut model does not run:"; cat "$T/err"; fail=1; }
for bad in 0 -1 x 4; do
    "$BIN" mkmodel --preset tiny --num-layers $bad --out "$T/bad" >/dev/null 2>"$T/err"
    rc=$?
    if [ $rc -ne 2 ] || ! grep -q -- "--num-layers" "$T/err"; then
        echo "FAIL: --num-layers $bad: exit $rc, $(cat "$T/err")"; fail=1
    fi
done
[ $fail -eq 0 ] && echo "mkmodel --num-layers: ok"
exit $fail
