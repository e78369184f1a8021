#!/usr/bin/env bash
# Run the whole test suite with the project's virtualenv. pytest exit code 5 ("no tests
# collected") is a failure here, like any other non-zero code.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
export TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-2}
export HGSGC_REQUIRE_CUSTOM_OPS=1  # the custom kernels must be built: their tests may not skip
.venv/bin/python -m pytest -ra -p no:cacheprovider tests "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "run_tests.sh: pytest collected no tests: failing" >&2
  exit 1
fi
exit "$rc"
