#!/usr/bin/env bash
# The interpreter `make` builds .venv from (the Makefile's PYTHON; PYTHON=... on the make
# line chooses one): python3 where it is 3.12 or newer, else a 3.12 installed with pyenv,
# else python3. CPython 3.11 and older, until late point releases, can leave a child
# forked while another thread held the interpreter's thread-state lock waiting on it for
# good (python/cpython#112275): a DataLoader worker forked as gloo's threads let go of a
# collective's tensors hangs its rank. 3.12 has the fix. Prints the interpreter's path.
set -uo pipefail
recent() {
    "$1" -c 'import sys; sys.exit(0 if sys.version_info[:2] >= (3, 12) else 1)' 2>/dev/null
}
first=$(command -v python3 || true)
if [[ -n $first ]] && recent "$first"; then
    echo "$first"
    exit 0
fi
root=$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")
for candidate in $(ls -d "$root"/versions/3.12.*/bin/python3 2>/dev/null | sort -rV); do
    if recent "$candidate"; then
        echo "$candidate"
        exit 0
    fi
done
echo "${first:-python3}"
