# Sourced by scripts/test and scripts/flake-hunt: the set-up the test suite needs.
# .venv with the test extras, and the real Pi 1.6.0 and its Node 22 from the committed
# lockfile, cached outside the clone (later runs reuse it) and installed before pytest so
# parallel workers never race to install it.
. scripts/_venv.sh '[test]'
export PI_RUNTIME_PI_HOME=${PI_RUNTIME_PI_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/pi-runtime/pi}
echo "== pi (the real Pi for the conformance and worker tests): $PI_RUNTIME_PI_HOME"
.venv/bin/pi-runtime pi install --home "$PI_RUNTIME_PI_HOME"
# Two test processes per core, at most 8: most tests wait on real processes, not the CPU.
# Work stealing: an idle process takes tests queued for a busy one, so a few long crash
# tests at the end of the order do not leave the other processes waiting (259 s -> 222 s).
test_workers=$(($(nproc) * 2))
[ "$test_workers" -le 8 ] || test_workers=8
test_parallel=(-n "$test_workers" --dist worksteal)
