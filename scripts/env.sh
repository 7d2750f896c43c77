# Sourced by the scripts: the environment OrbitKV's binaries and tests run in.
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export VIRTUAL_ENV="$ROOT/.venv"
export PATH="$VIRTUAL_ENV/bin:$PATH"
# Mooncake logs INFO lines through glog; keep warnings and errors.
export GLOG_minloglevel=${GLOG_minloglevel:-1}
