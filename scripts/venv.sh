# Sourced by the scripts that run Python (test.sh, make-fixtures.sh): makes sure `.venv/` (inside
# the repository, git-ignored) exists and holds scripts/requirements.txt, saying what it creates
# and installs before doing it, and puts it first on PATH, so `python3` below means the venv's.
# Nothing is installed into the system's Python. A venv already up to date is left as it is
# (pip is not run again unless requirements.txt is newer than the venv's stamp).
#
#   . scripts/venv.sh      (from the repository root)
VENV="$PWD/.venv"
if [ ! -x "$VENV/bin/python3" ]; then
  echo "== creating a Python virtual environment in $VENV (python3 -m venv; nothing goes into the system's Python)"
  python3 -m venv "$VENV"
fi
if [ ! -e "$VENV/.k3-requirements" ] || [ scripts/requirements.txt -nt "$VENV/.k3-requirements" ]; then
  echo "== installing into $VENV: $(grep -v '^#' scripts/requirements.txt | tr '\n' ' ')(scripts/requirements.txt, with their dependencies)"
  "$VENV/bin/python3" -m pip install --disable-pip-version-check -r scripts/requirements.txt
  cp scripts/requirements.txt "$VENV/.k3-requirements"
else
  echo "== using the Python virtual environment $VENV (scripts/requirements.txt already installed)"
fi
export VIRTUAL_ENV="$VENV"
export PATH="$VENV/bin:$PATH"
