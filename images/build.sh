#!/usr/bin/env bash
# Builds Baton's images from the repository root with docker or podman, tags them, optionally pushes.
#
#   images/build.sh                      # all four, tagged $REGISTRY/<name>:<version of baton/__init__.py>
#   images/build.sh engine-cpu router    # some of them
#   images/build.sh --pin-digests        # build FROM base@sha256:... (resolved now, printed for the record)
#   images/build.sh --push               # push after building
#   images/build.sh --list               # print "dockerfile image" per image and exit (tests read this)
#
# Environment: REGISTRY (default ghcr.io/baton-llm), VERSION (default baton.__version__),
# CONTAINER_TOOL (default: docker if present, else podman), PLATFORM (e.g. linux/amd64).
# The names are the ones manifests/, the chart and the samples use (tests/test_images.py checks it).
set -euo pipefail
cd "$(dirname "$0")/.."

REGISTRY="${REGISTRY:-ghcr.io/baton-llm}"
VERSION="${VERSION:-$(sed -n 's/^__version__ = "\(.*\)"$/\1/p' baton/__init__.py)}"
# name -> image reference; the Dockerfile is images/<name>.Dockerfile
declare -A IMAGES=(
    [engine-cpu]="$REGISTRY/baton:$VERSION"
    [engine-cuda]="$REGISTRY/baton:$VERSION-cuda"
    [router]="$REGISTRY/baton-router:$VERSION"
    [operator]="$REGISTRY/baton-operator:$VERSION"
)
ORDER=(engine-cpu engine-cuda router operator)

push=0 pin=0 list=0 chosen=()
for arg in "$@"; do
    case "$arg" in
        --push) push=1 ;;
        --pin-digests) pin=1 ;;
        --list) list=1 ;;
        -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
        -*) echo "unknown option $arg" >&2; exit 2 ;;
        *) [[ -n "${IMAGES[$arg]:-}" ]] || { echo "unknown image $arg (one of ${ORDER[*]})" >&2; exit 2; }
           chosen+=("$arg") ;;
    esac
done
[[ ${#chosen[@]} -gt 0 ]] || chosen=("${ORDER[@]}")

if [[ $list -eq 1 ]]; then
    for name in "${chosen[@]}"; do echo "images/$name.Dockerfile ${IMAGES[$name]}"; done
    exit 0
fi

TOOL="${CONTAINER_TOOL:-$(command -v docker >/dev/null && echo docker || echo podman)}"
command -v "$TOOL" >/dev/null || { echo "neither docker nor podman found (set CONTAINER_TOOL)" >&2; exit 1; }

# The base-image ARGs of a Dockerfile (ARG X_IMAGE=ref before the first FROM) -> --build-arg X_IMAGE=ref@digest.
digest_of() {
    if command -v skopeo >/dev/null; then
        skopeo inspect --format '{{.Digest}}' "docker://$1"
    elif [[ "$TOOL" == docker ]]; then
        docker buildx imagetools inspect --format '{{.Manifest.Digest}}' "$1"
    else
        podman pull -q "$1" >/dev/null && podman image inspect --format '{{.Digest}}' "$1"
    fi
}
pin_bases() {  # appends --build-arg X_IMAGE=ref@digest to `args` for each base-image ARG of $1
    local arg ref digest
    while IFS='=' read -r arg ref; do
        digest="$(digest_of "$ref")" || digest=""
        [[ "$digest" == sha256:* ]] || { echo "could not resolve the digest of $ref" >&2; exit 1; }
        echo "pinned $ref@$digest"
        args+=(--build-arg "$arg=$ref@$digest")
    done < <(sed -n 's/^ARG \([A-Z_]*_IMAGE\)=\(.*\)$/\1=\2/p' "$1")
}

for name in "${chosen[@]}"; do
    file="images/$name.Dockerfile" ref="${IMAGES[$name]}"
    args=(build -f "$file" -t "$ref" --label "org.opencontainers.image.version=$VERSION"
          --label "org.opencontainers.image.revision=$(git rev-parse HEAD 2>/dev/null || echo unknown)")
    [[ -n "${PLATFORM:-}" ]] && args+=(--platform "$PLATFORM")
    if [[ $pin -eq 1 ]]; then pin_bases "$file"; fi
    echo "==> $ref ($file)"
    "$TOOL" "${args[@]}" .
    if [[ $push -eq 1 ]]; then "$TOOL" push "$ref"; fi
done
