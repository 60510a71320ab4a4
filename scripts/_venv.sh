# Sourced by scripts/test and scripts/serve: create .venv (once) and install the package
# with the given extras into it. Usage: . scripts/_venv.sh [EXTRAS]
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check --upgrade pip
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".${1:-}"
