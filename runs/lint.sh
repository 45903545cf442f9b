#!/usr/bin/env bash
# The code's own checks, as CI runs them: ruff's lint rules, ruff's formatting (checked, not applied) and the import
# layers (import-linter; the contracts are in pyproject.toml). `bash runs/lint.sh --fix` applies ruff's fixes and
# formatting first. Needs the lint extra: pip install -e ".[lint]"
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  -h|--help) sed -n '2,4p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
  --fix) ruff check --fix . && ruff format . ;;
  "") ;;
  *) echo "usage: bash runs/lint.sh [--fix]" >&2; exit 2 ;;
esac
ruff check .
ruff format --check .
lint-imports
