# Sourced by scripts/test, scripts/serve and scripts/flake-hunt: create .venv (once) and install
# the package with the given extras into it, quietly. Usage: . scripts/_venv.sh EXTRAS
# (always give it, "" for none: a script sourced without arguments sees its caller's).
#
# It prints one line; pip's own output goes to .venv/setup.log, which the message names when
# the set-up fails. Nothing is reinstalled while pyproject.toml and the extras are unchanged
# (the install is editable: code changes need no reinstall).
PYTHON=${PYTHON:-python3}
_extras=${1:-}
_log=.venv/setup.log
_stamp=".venv/setup.stamp"
_want="$(cat pyproject.toml scripts/_venv.sh | sha256sum | cut -c1-16) ${_extras}"
if [ -x .venv/bin/python ] && [ -f "$_stamp" ] && grep -qxF "$_want" "$_stamp"; then
    :
else
    echo "== setting up .venv (pi-runtime${_extras}); pip's output: ${_log}" >&2
    if [ ! -x .venv/bin/python ]; then
        if ! "$PYTHON" -m venv .venv >/tmp/pi-runtime-venv.$$.log 2>&1; then
            cat /tmp/pi-runtime-venv.$$.log >&2
            rm -f /tmp/pi-runtime-venv.$$.log
            echo "set-up failed: cannot create .venv with $PYTHON" >&2
            exit 1
        fi
        rm -f /tmp/pi-runtime-venv.$$.log
    fi
    : >"$_log"
    if ! { .venv/bin/python -m pip install --disable-pip-version-check --upgrade pip \
            && .venv/bin/python -m pip install --disable-pip-version-check -e ".${_extras}"; \
         } >>"$_log" 2>&1; then
        tail -n 20 "$_log" >&2
        echo "set-up failed: pip could not install pi-runtime${_extras}; the whole log: ${_log}" >&2
        exit 1
    fi
    # One stamp line per set of extras installed for this pyproject.toml (a changed one
    # starts the list again).
    if [ -f "$_stamp" ] && grep -q "^${_want%% *} " "$_stamp"; then
        printf '%s\n' "$_want" >>"$_stamp"
    else
        printf '%s\n' "$_want" >"$_stamp"
    fi
fi
unset _extras _log _stamp _want
