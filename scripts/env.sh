# Sourced by the scripts: a valid XDG runtime dir (silences a wgpu warning).
if [ -z "${XDG_RUNTIME_DIR:-}" ] || [ ! -d "${XDG_RUNTIME_DIR}" ]; then
  export XDG_RUNTIME_DIR=/tmp/xquant-xdg-runtime
  mkdir -p -m 0700 "$XDG_RUNTIME_DIR"
fi
