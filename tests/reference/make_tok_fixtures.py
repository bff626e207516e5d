#!/usr/bin/env python3
"""Golden token ids for tokenizer/ from Hugging Face `tokenizers`.

Reads the corpus (tests/reference/tokenizer_corpus.jsonl), builds each test
text, encodes it with the reference and writes tests/reference/fixtures/
tok_ids.json, which tokenizer/tests/test_tokenizer.c compares against.

    python3 tests/reference/make_tok_fixtures.py \\
        --tokenizer .cache/tokenizer-deepseek_v3/tokenizer.json \\
        --corpus tests/reference/tokenizer_corpus.jsonl \\
        --out tests/reference/fixtures/tok_ids.json

Needs only Python 3 and `tokenizers` (made with 0.23).

Corpus format: one JSON object per line, with "name" and exactly one of
  "text": the string itself;
  "repeat" + "count" (+ optional "prefix", "suffix"): prefix + repeat * count
      + suffix, for long inputs that would bloat the file;
  "bytes_hex": raw bytes, possibly ill-formed UTF-8; the text is
      bytes.decode("utf-8", errors="replace"), the string a server builds
      from such a request. The C test feeds the raw bytes to pd_tok_encode,
      which must repair them the same way.

For each case the fixture records:
  ids             tok.encode(text, add_special_tokens=False).ids
  ids_no_special  the same with tok.encode_special_tokens = True (special
                  added tokens are plain text; pd_tok_encode parse_special=false);
                  left out when equal to ids
  text_bytes, text_fnv1a64
                  UTF-8 length and FNV-1a 64 of the text, so the C test can
                  tell that it built the same text (a stale fixture fails
                  loudly instead of comparing the wrong thing)
  decoded_fnv1a64, decoded_bytes
                  of tok.decode(ids, skip_special_tokens=False)
  decoded_skip_fnv1a64, decoded_skip_bytes
                  of tok.decode(ids, skip_special_tokens=True)

and, over the whole vocabulary, "vocab_roundtrip": every id that names a
token which is not special and whose text (tok.decode([id])) holds no
U+FFFD is encoded from that text; "tried" counts them, "single" counts
those that come back as exactly [id], and "fnv1a64" hashes, for each in id
order, the little-endian int32s id, len(ids), ids...
"""
import argparse
import hashlib
import json
import os
import struct
import sys

from tokenizers import Tokenizer, __version__ as tokenizers_version


def fnv1a64(data: bytes) -> str:
    h = 0xCBF29CE484222325
    for b in data:
        h ^= b
        h = (h * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return "%016x" % h


def build_text(case: dict) -> str:
    kinds = [k for k in ("text", "repeat", "bytes_hex") if k in case]
    if len(kinds) != 1:
        raise ValueError("case %r: need exactly one of text, repeat, bytes_hex" % case.get("name"))
    if "text" in case:
        return case["text"]
    if "repeat" in case:
        return case.get("prefix", "") + case["repeat"] * int(case["count"]) + case.get("suffix", "")
    return bytes.fromhex(case["bytes_hex"]).decode("utf-8", errors="replace")


class Fnv1a64:
    def __init__(self):
        self.h = 0xCBF29CE484222325

    def update(self, data: bytes):
        h = self.h
        for b in data:
            h ^= b
            h = (h * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
        self.h = h

    def hexdigest(self) -> str:
        return "%016x" % self.h


def vocab_roundtrip(tok) -> dict:
    specials = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    max_id = max(tok.get_vocab(with_added_tokens=True).values())
    ids, texts = [], []
    for i in range(max_id + 1):
        if i in specials or tok.id_to_token(i) is None:
            continue
        text = tok.decode([i], skip_special_tokens=False)
        if "\ufffd" in text:
            continue
        ids.append(i)
        texts.append(text)
    tok.encode_special_tokens = False
    encs = tok.encode_batch(texts, add_special_tokens=False)
    h = Fnv1a64()
    single = 0
    for i, enc in zip(ids, encs):
        got = enc.ids
        single += got == [i]
        h.update(struct.pack("<ii", i, len(got)) + struct.pack("<%di" % len(got), *got))
    return {"tried": len(ids), "single": single, "fnv1a64": h.hexdigest()}


def read_corpus(path: str) -> list:
    cases = []
    with open(path, "rb") as f:
        # split on b"\n" only: a JSON line may hold U+2028 or U+0085 raw
        for lineno, raw in enumerate(f.read().split(b"\n"), 1):
            if not raw.strip():
                continue
            case = json.loads(raw.decode("utf-8"))
            if "name" not in case:
                raise ValueError("%s:%d: no name" % (path, lineno))
            cases.append(case)
    return cases


def file_sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokenizer", required=True, help="path to tokenizer.json")
    ap.add_argument("--corpus", required=True, help="path to tokenizer_corpus.jsonl")
    ap.add_argument("--out", required=True, help="fixture to write (tok_ids.json)")
    args = ap.parse_args()

    tok = Tokenizer.from_file(args.tokenizer)
    if not hasattr(tok, "encode_special_tokens"):
        sys.exit("tokenizers %s has no Tokenizer.encode_special_tokens; use 0.23" % tokenizers_version)
    cases = read_corpus(args.corpus)
    out_cases = []
    for case in cases:
        text = build_text(case)
        tok.encode_special_tokens = False
        ids = tok.encode(text, add_special_tokens=False).ids
        tok.encode_special_tokens = True
        ids_plain = tok.encode(text, add_special_tokens=False).ids
        tok.encode_special_tokens = False
        dec = tok.decode(ids, skip_special_tokens=False).encode("utf-8")
        dec_skip = tok.decode(ids, skip_special_tokens=True).encode("utf-8")
        tb = text.encode("utf-8")
        entry = {
            "name": case["name"],
            "text_bytes": len(tb),
            "text_fnv1a64": fnv1a64(tb),
            "ids": ids,
        }
        if ids_plain != ids:
            entry["ids_no_special"] = ids_plain
        entry.update({
            "decoded_bytes": len(dec),
            "decoded_fnv1a64": fnv1a64(dec),
            "decoded_skip_bytes": len(dec_skip),
            "decoded_skip_fnv1a64": fnv1a64(dec_skip),
        })
        out_cases.append(entry)

    vocab = vocab_roundtrip(tok)
    fixture = {
        "generated_by": "python3 tests/reference/make_tok_fixtures.py --tokenizer %s --corpus %s --out %s"
        % (args.tokenizer, args.corpus, args.out),
        "tokenizers_version": tokenizers_version,
        "tokenizer_sha256": file_sha256(args.tokenizer),
        "corpus_sha256": file_sha256(args.corpus),
        "vocab_roundtrip": vocab,
        "cases": out_cases,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        # one case per line keeps diffs of a regenerated fixture readable
        f.write("{\n")
        for key in ("generated_by", "tokenizers_version", "tokenizer_sha256", "corpus_sha256",
                    "vocab_roundtrip"):
            f.write("  %s: %s,\n" % (json.dumps(key), json.dumps(fixture[key])))
        f.write('  "cases": [\n')
        for i, c in enumerate(out_cases):
            f.write("    " + json.dumps(c, separators=(",", ":")) + (",\n" if i + 1 < len(out_cases) else "\n"))
        f.write("  ]\n}\n")
    print("%s: %d cases, tokenizers %s" % (args.out, len(out_cases), tokenizers_version), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
