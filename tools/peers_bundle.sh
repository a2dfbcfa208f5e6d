#!/usr/bin/env bash
# Carry the peers of the benchmarks (LMCache, PegaFlow) to the GPU machine: download their
# cp312 wheels, and the few packages they import that neither the GPU image nor the vLLM
# 0.26.0 bundle (../shared/gpu/make-vllm-bundle.sh) has, into one chunk folder of about 23 MiB,
# with tools/lib/peer_imports.py, which unpack.sh runs there: every module each peer's server and
# connector import, at start and once running, imported at once (a missing one fails the unpack).
#
# usage: bash tools/peers_bundle.sh [OUT_DIR]      (default: .gpu-bundle/peers, git-ignored)
#
# On the GPU machine, after the vLLM bundle is unpacked into $HOME/vb (its README), one more
# command moves this chunk out of the tree and unpacks each peer into a folder of its own
# (PegaFlow's package is also called `pegaflow`: it must never share a path with this repo's):
#
#   mkdir -p $HOME/vb/peers && mv .gpu-bundle/peers/* $HOME/vb/peers/ && bash $HOME/vb/peers/unpack.sh
#
# then tools/lib/peers.py finds them there (PEGAFLOW_PEERS_DIR overrides $HOME/vb/peers).
# unpack.sh's check finds vLLM's bundle at $HOME/vb/site (VLLM_BUNDLE_SITE overrides it).
set -euo pipefail
out="${1:-.gpu-bundle/peers}"

# peer folder -> wheels (exact versions; docs/peers.md says why each is needed). LMCache's server
# imports the Prometheus exporter at its application's startup (its metrics, without an OTLP
# endpoint): 0.66b2 is the one built for the vLLM bundle's opentelemetry-sdk 1.45.2 (it pins
# sdk~=1.45.2; LMCache's own <=0.61b0 pin would need sdk 1.40). prometheus-client 0.24.1: the
# newest LMCache allows (<=0.24.1), which the exporter (<1.0) and vLLM (>=0.18) allow too;
# carried rather than left to the image's unknown version.
lmcache=(lmcache==0.5.3 aiofile==3.12.3 caio==0.12.10 sortedcontainers==2.4.0
         opentelemetry-exporter-prometheus==0.66b2 prometheus-client==0.24.1)
pegaflow_rs=(pegaflow-llm-cu13==0.25.1)

# glibc 2.28 at most for LMCache's folder (caio then comes as its pure-Python wheel); PegaFlow
# 0.25.1 is built for glibc 2.34 only.
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64)
pyargs=(--python-version 3.12 --implementation cp --only-binary=:all: "${plat[@]}")

fetch() {  # fetch FOLDER SPEC...: exactly the wheels of SPEC into $out/FOLDER (pip caches them)
  local folder="$1"; shift
  mkdir -p "$out/$folder"
  python3 -m pip download -q --no-deps "${pyargs[@]}" -d "$out/$folder" "$@" \
    2> >(grep -v "is ignored: it is neither" >&2)
}
rm -rf "$out"; mkdir -p "$out"
fetch lmcache "${lmcache[@]}"
pyargs+=(--platform manylinux_2_34_x86_64)
fetch pegaflow-rs "${pegaflow_rs[@]}"
cat > "$out/unpack.sh" <<'EOF'
#!/usr/bin/env bash
# Unpack each peer's wheels into a folder of its own beside this script (no pip needed).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
for folder in lmcache pegaflow-rs; do
  for wheel in "$here/$folder"/*.whl; do
    python3 - "$wheel" "$here/$folder/site" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    z.extractall(sys.argv[2])
PY
  done
done
chmod +x "$here"/pegaflow-rs/site/pegaflow/pegaflow-server-py "$here"/pegaflow-rs/site/pegaflow/pegaflow-metaserver-py
echo "peers unpacked under $here: lmcache/site, pegaflow-rs/site"
# Every module each peer imports, now: a missing one costs seconds here, not a bench. -P: the
# script's folder (this one) never goes on sys.path.
vllm_site="${VLLM_BUNDLE_SITE:-$(dirname "$here")/site}"
for folder in lmcache pegaflow-rs; do
  if ! (cd /tmp && PYTHONPATH="$here/$folder/site:$vllm_site" LMCACHE_TRACK_USAGE=false \
        python3 -P "$here/peer_imports.py" "$folder"); then
    echo "unpack.sh: FAILED: $folder's bundle lacks the modules above (tools/peers_bundle.sh)" >&2
    exit 1
  fi
done
EOF
cp tools/lib/peer_imports.py "$out/peer_imports.py"
chmod +x "$out/unpack.sh"
du -sh "$out" >&2
find "$out" -name '*.whl' -printf '%s\t%p\n' | sort -rn >&2
echo "peers bundle ready in $out: move it to the GPU machine as tools/peers_bundle.sh's header says" >&2
