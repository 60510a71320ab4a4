# Sourced by scripts/test and scripts/flake-hunt: the set-up the test suite needs.
# .venv with the test extras, and the real Pi 1.6.0 and its Node 22 from the committed
# lockfile, cached outside the clone (later runs reuse it) and installed before pytest so
# parallel workers never race to install it.
. scripts/_venv.sh '[test]'
# Debian's Chromium for the operator page's browser tests (tests/server/test_operator_browser.py,
# driven by Playwright with executable_path): installed once when missing.
if ! command -v chromium >/dev/null 2>&1; then
    echo "== chromium (the operator page's browser tests): apt-get install chromium" >&2
    _apt_log=.venv/apt.log
    if ! { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; } \
            >"$_apt_log" 2>&1; then
        tail -n 20 "$_apt_log" >&2
        echo "set-up failed: cannot install chromium (as root: apt-get install chromium)" >&2
        exit 1
    fi
    unset _apt_log
fi
export PI_RUNTIME_PI_HOME=${PI_RUNTIME_PI_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/pi-runtime/pi}
echo "== pi (the real Pi for the conformance and worker tests): $PI_RUNTIME_PI_HOME"
.venv/bin/pi-runtime pi install --home "$PI_RUNTIME_PI_HOME"
# Two test processes per core, at most 8: most tests wait on real processes, not the CPU.
# Work stealing: an idle process takes tests queued for a busy one, so a few long crash
# tests at the end of the order do not leave the other processes waiting (259 s -> 222 s).
test_workers=$(($(nproc) * 2))
[ "$test_workers" -le 8 ] || test_workers=8
test_parallel=(-n "$test_workers" --dist worksteal)
