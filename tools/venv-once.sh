# Sourced by the tools/*-venv.sh scripts: build a venv once, whoever asks first.
#
#   source "$(dirname "$0")/venv-once.sh"; venv_once "$venv" "$REVISION"   # ... install ...; venv_done
#
# `venv_once` takes a lock beside the venv (two calls at once, CI's background build and a test's fixture, take
# turns: the second waits and finds the venv built), prints the venv's python and exits when the marker file
# .treerl-complete holds REVISION, and otherwise creates the venv afresh. `venv_done` writes the marker and prints
# the python: a venv without it (a stopped install, an earlier revision) is built again next time.

venv_once() {
    VENV_ONCE_DIR="$1"
    VENV_ONCE_REVISION="$2"
    mkdir -p "$(dirname "$VENV_ONCE_DIR")"
    exec 9>"$VENV_ONCE_DIR.lock"
    flock 9
    if [ "$(cat "$VENV_ONCE_DIR/.treerl-complete" 2>/dev/null)" = "$VENV_ONCE_REVISION" ]; then
        echo "$VENV_ONCE_DIR/bin/python"
        exit 0
    fi
    rm -rf "$VENV_ONCE_DIR"
    python3 -m venv "$VENV_ONCE_DIR"
}

venv_done() {
    echo "$VENV_ONCE_REVISION" >"$VENV_ONCE_DIR/.treerl-complete"
    echo "$VENV_ONCE_DIR/bin/python"
}
