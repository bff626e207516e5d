#!/bin/sh
# Lists what a binary needs at run time, for the runtime stage of
# deploy/Dockerfile. Run in the build stage:
#   deploy/runtime-deps.sh BINARY OUTDIR
# writes OUTDIR/packages: the distribution packages owning every shared
# library the binary loads (ldd), one a line; and copies into OUTDIR/lib the
# libraries no package owns (a toolkit installed outside dpkg, say).
# The runtime stage installs the packages it lacks and copies OUTDIR/lib.
set -eu
BIN="$1"
OUT="$2"
mkdir -p "$OUT/lib"
: >"$OUT/packages.all"
ldd "$BIN" | awk '/=> \// {print $3} /^[[:space:]]*\/[^ ]+ \(/ {print $1}' | sort -u | while read -r lib; do
    pkg=""
    # usrmerge: dpkg may know the file as /lib/... or /usr/lib/...; alternatives:
    # the real file behind the symlink (libopenblas.so.0 -> openblas-pthread/...)
    for cand in "$lib" "$(readlink -f "$lib")" "/usr$lib" "${lib#/usr}"; do
        [ -n "$cand" ] || continue
        pkg=$(dpkg-query -S "$cand" 2>/dev/null | head -n 1 | cut -d: -f1) || true
        [ -n "$pkg" ] && break
    done
    case "$lib" in
    */libcuda.so* | */libnvidia-*) continue ;; # the driver: the container runtime mounts it
    esac
    if [ -n "$pkg" ]; then
        echo "$pkg" >>"$OUT/packages.all"
    else
        echo "runtime-deps: $lib is in no package: copied" >&2
        cp -L "$lib" "$OUT/lib/"
    fi
done
sort -u "$OUT/packages.all" >"$OUT/packages"
rm -f "$OUT/packages.all"
echo "runtime-deps: $(wc -l <"$OUT/packages") packages: $(tr '\n' ' ' <"$OUT/packages")"
