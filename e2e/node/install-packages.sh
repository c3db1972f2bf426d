#!/usr/bin/env bash
# Debian packages the real node (containerd, runc, CNI plugins, iptables,
# conntrack) and the image build (debootstrap, umoci, busybox-static, gcc)
# need, and libsodium (tensorizer's encryption, via libnacl). pigz: containerd
# decompresses layers through unpigz when it finds it, and importing the
# vllm-cpu image (3.5 GB of gzip layers) took 89 s with it, 119 s without
# (quiet machine, cold page cache). Installs only what is missing; needs root.
set -euo pipefail
packages=(containerd runc containernetworking-plugins iptables conntrack iproute2 debootstrap debian-archive-keyring umoci busybox-static gcc libc6-dev libsodium23 pigz)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[[ ${#missing[@]} -eq 0 ]] && exit 0
if [[ $(id -u) -ne 0 ]]; then
  echo "install-packages.sh: missing Debian packages: ${missing[*]} (run as root, or install them)" >&2
  exit 1
fi
echo "[node] installing ${missing[*]}" >&2
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
