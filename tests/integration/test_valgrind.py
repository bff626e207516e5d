#!/usr/bin/env python3
"""Valgrind memcheck of the serving path (tests/valgrind/run.py): gateway,
prefill and decode replicas under valgrind with the tiny model, a few
requests (short, chat, long through prefill + KV transfer, client
disconnects), SIGTERM; fails on any memcheck error or definite leak not
suppressed in tests/valgrind/pdserve.supp. Skipped without valgrind and in
the sanitizer build (ASan and valgrind do not mix)."""
import os, shutil, sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "valgrind"))

if __name__ == "__main__":
    if os.environ.get("PD_SANITIZED", "").lower() in ("1", "true", "on", "yes"):
        print("skipped: sanitizer build")
        sys.exit(0)
    if not shutil.which("valgrind"):
        print("skipped: valgrind is not installed")
        sys.exit(0)
    import run  # noqa: E402
    run.main()
