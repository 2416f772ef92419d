#!/usr/bin/env bash
# The compiled fast paths (msgq_trio/protocol/_speedups.c) under AddressSanitizer and
# UndefinedBehaviorSanitizer: the protocol tests, the client behaviour tests on the trio
# driver and the differential fuzz (tests/protocol/differential.py), with the extension
# built sanitized into a copy of the tree (the checkout's own build is left as it is).
#
#   tests/protocol/sanitize.sh [pytest arguments instead of the default selection]
#
# PYTHON: the interpreter (default .venv/bin/python, whose packages the tests use);
# MSGQ_TRIO_FUZZ_COUNT / MSGQ_TRIO_FUZZ_SEED: the fuzz's cases (default 5000) and seed.
# The interpreter itself is not sanitized: libasan is preloaded so that it comes first,
# leak detection is off (CPython keeps objects until exit by design), and PYTHONMALLOC=malloc
# sends every object allocation through ASan's malloc (pymalloc's arenas would hide an
# overrun of a small object). Any report aborts the process, which fails the run; the
# reports go to files (pytest captures stderr, and an aborted process never shows it),
# printed at the end. An allocation too large for ASan fails as MemoryError, as it does
# without it.
set -euo pipefail
cd "$(dirname "$0")/../.."
py=$(realpath "${PYTHON:-.venv/bin/python}")
CC=${CC:-gcc}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
git ls-files -z --cached --others --exclude-standard | while IFS= read -r -d '' f; do
    if [ -f "$f" ]; then mkdir -p "$work/$(dirname "$f")" && cp -p "$f" "$work/$f"; fi
done
# Packages that pyproject.toml maps from other directories (msgq_trio.plugins is
# plugins/, ...) where an installed package has them.
"$py" - "$work" <<'PY'
import os, shutil, sys, tomllib
with open("pyproject.toml", "rb") as f:
    dirs = tomllib.load(f)["tool"]["setuptools"].get("package-dir", {})
for pkg, src in dirs.items():
    dest = os.path.join(sys.argv[1], *pkg.split("."))
    if os.path.normpath(src) != os.path.normpath(os.path.join(*pkg.split("."))):
        shutil.copytree(src, dest, dirs_exist_ok=True)
PY
inc=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
suffix=$("$py" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
rm -f "$work"/msgq_trio/protocol/_speedups*.so
"$CC" -shared -fPIC -g -O1 -fno-omit-frame-pointer -fsanitize=address,undefined \
    -fno-sanitize-recover=all -Wall -Wextra -Wno-unused-parameter \
    -Wno-missing-field-initializers -Wno-cast-function-type -I"$inc" \
    msgq_trio/protocol/_speedups.c -o "$work/msgq_trio/protocol/_speedups$suffix"
libasan=$("$CC" -print-file-name=libasan.so)
cd "$work"
export LD_PRELOAD=$libasan
logs=$work/.sanitizer-logs
mkdir "$logs"
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:detect_stack_use_after_return=1:allocator_may_return_null=1:log_path=$logs/asan
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1:log_path=$logs/ubsan
export PYTHONMALLOC=malloc
export PYTHONPATH=$work
export MSGQ_TRIO_TEST_BUILDS=compiled
export MSGQ_TRIO_FUZZ_COUNT=${MSGQ_TRIO_FUZZ_COUNT:-5000}
unset MSGQ_TRIO_PURE_PYTHON
# The tests must run the sanitized build, not an installed one.
"$py" - "$work" <<'PY'
import sys
from msgq_trio.protocol import _speedups, framing
assert _speedups.__file__.startswith(sys.argv[1]), _speedups.__file__
assert framing.SPEEDUPS, "the sanitized build is not in use"
print("sanitized build:", _speedups.__file__)
PY
if [ $# -eq 0 ]; then
    # The client behaviour tests on one driver (trio): all three under ASan take too long
    # for CI, and the codec they exercise is the same.
    set -- -n 2 --dist loadfile -p no:benchmark tests/protocol tests/client/test_behaviour.py \
        -k "not direct and not asyncio"
fi
status=0
"$py" -m pytest -q -p no:cacheprovider "$@" || status=$?
if [ -n "$(ls -A "$logs")" ]; then
    echo "sanitizer output:" >&2
    cat "$logs"/* >&2
    # (a warning alone, such as a refused huge allocation, is not a failure)
    if grep -qE "ERROR: AddressSanitizer|runtime error:" "$logs"/*; then status=1; fi
fi
exit $status
