#!/usr/bin/env bash
# The wheel as a user gets it: `pip wheel .` builds it, a fresh virtual environment installs it
# (numpy from the package index, as for any user), and from there `ferry --version` runs, the
# package imports and moves bytes over tcp, and examples/cpp builds against the wheel's CMake
# package (find_package(ferry)) and pkg-config file, then runs.
#   wheel_test.sh SRC PYTHON WORK
# SRC: the repository; PYTHON: an interpreter with the tools of requirements/build.txt (the
# build's venv); WORK: a folder kept between runs (the wheel's CMake build, reused there, so a
# second run rebuilds only what changed). Everything else goes into a temporary folder.
set -euo pipefail
src=$(cd "${1:?usage: wheel_test.sh SRC PYTHON WORK}" && pwd)
python=${2:?}
work=${3:?}
mkdir -p "$work"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "wheel_test: FAILED: $*" >&2; exit 1; }
step() { echo "== wheel_test: $*"; }

step "pip wheel . (build folder $work/build)"
t0=$(date +%s)
"$python" -m pip wheel "$src" --no-build-isolation --no-deps --disable-pip-version-check \
  -w "$tmp/dist" --config-settings=build-dir="$work/build" > "$tmp/wheel.log" 2>&1 \
  || { tail -50 "$tmp/wheel.log"; fail "pip wheel ."; }
whl=$(ls "$tmp"/dist/ferry-*.whl)
echo "built $(basename "$whl"): $(du -k "$whl" | cut -f1) KiB in $(( $(date +%s) - t0 )) s"
"$python" -c "import sys, zipfile; print('unpacked: %d KiB' % (sum(i.file_size for i in
  zipfile.ZipFile(sys.argv[1]).infolist()) >> 10))" "$whl"

step "the wheel holds the extension and its stub, libferry, headers, CMake, pkg-config, the command"
"$python" - "$whl" <<'PY' || fail "the wheel lacks files (listed above)"
import re, sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
want = [r"ferry/__init__\.py", r"ferry/_ferry\..*\.so", r"ferry/_ferry\.pyi", r"ferry/py\.typed",
        r"ferry/lib/libferry\.so",
        r"ferry/include/ferry/fabric/engine\.h", r"ferry/lib/cmake/ferry/ferryConfig\.cmake",
        r"ferry/lib/pkgconfig/ferry\.pc", r"ferry-[0-9.]+\.data/scripts/ferry"]
missing = [w for w in want if not any(re.fullmatch(w, n) for n in names)]
for w in missing:
    print("missing:", w)
# A wheel holds no symlinks: versioned names would be whole copies of the library.
copies = [n for n in names if re.fullmatch(r"ferry/lib/libferry\.so\..*", n)]
for n in copies:
    print("a copy of libferry.so:", n)
# The pure-Python modules carry their own docstrings and annotations: no stub beside them.
stubs = [n for n in names if re.fullmatch(r"ferry/(__init__|kv|moe)\.pyi|ferry/_docs\.py", n)]
for n in stubs:
    print("a stub of a pure-Python module:", n)
sys.exit(1 if missing or copies or stubs else 0)
PY

step "install into a fresh virtual environment"
"$python" -m venv "$tmp/venv" || fail "python -m venv"
"$tmp/venv/bin/python" -m pip install -q --disable-pip-version-check "$whl" \
  || fail "pip install the wheel"

step "ferry --version from the venv's PATH"
cd "$tmp"  # nothing of the source tree on sys.path
out=$(PATH="$tmp/venv/bin:$PATH" ferry --version) || fail "ferry --version"
echo "$out"
case "$out" in *0.*) ;; *) fail "ferry --version printed '$out'" ;; esac
[ "$(PATH="$tmp/venv/bin:$PATH" command -v ferry)" = "$tmp/venv/bin/ferry" ] \
  || fail "ferry on PATH is not the venv's"

step "import ferry and a 1 MiB write over tcp"
"$tmp/venv/bin/python" - "$tmp/venv" <<'PY' || fail "the installed package"
import sys
import numpy as np
import ferry
assert ferry.__file__.startswith(sys.argv[1]), f"ferry imported from {ferry.__file__}"
a, b = ferry.TransferEngine("tcp"), ferry.TransferEngine("tcp")
n = 1 << 20
src = a.register(np.arange(n, dtype=np.uint8))
out = np.zeros(n, dtype=np.uint8)
dst = b.register(out)
op = a.write(a.connect(b.address), src, 0, dst.descriptor, 0, n, imm=7)
op.wait(timeout=30.0)
b.wait_imm(7, op.imm_writes, timeout=30.0)
assert (out == np.arange(n, dtype=np.uint8)).all(), "the bytes differ"
print("write over tcp from", ferry.__file__)
import ferry.kv
assert "FNV-1a" in (ferry.kv.transfer_key.__doc__ or ""), "help() text missing"
PY

site=$("$tmp/venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['platlib'])")
step "examples/cpp through find_package(ferry) with CMAKE_PREFIX_PATH=$site"
cmake -S "$src/examples/cpp" -B "$tmp/ex" -G Ninja -DCMAKE_PREFIX_PATH="$site" \
  > "$tmp/ex.log" 2>&1 || { cat "$tmp/ex.log"; fail "configure examples/cpp"; }
grep -q "ferry_DIR:PATH=$site/ferry/lib/cmake/ferry" "$tmp/ex/CMakeCache.txt" \
  || fail "find_package(ferry) found $(grep ferry_DIR "$tmp/ex/CMakeCache.txt"), not the wheel's"
cmake --build "$tmp/ex" > "$tmp/ex.log" 2>&1 || { cat "$tmp/ex.log"; fail "build examples/cpp"; }
timeout 120 "$tmp/ex/engine_write" tcp || fail "examples/cpp engine_write over tcp"

step "pkg-config --cflags --libs ferry from the wheel"
inc=$(PKG_CONFIG_PATH="$site/ferry/lib/pkgconfig" pkg-config --cflags-only-I ferry | tr ' ' '\n' \
  | sed -n 's/^-I//p' | head -1) || fail "pkg-config --cflags ferry"
[ "$(realpath "$inc")" = "$(realpath "$site/ferry/include")" ] \
  || fail "ferry.pc points at $inc, not the wheel's $site/ferry/include"
step "passed"
