#!/usr/bin/env bash
# iproute2 (ip, tc), iptables and util-linux (unshare) for the multi-node tier (pytest -m
# multinode: a cluster of network namespaces, as root; scripts/apt_install.sh).
exec bash "$(dirname "$0")/apt_install.sh" install_netns \
    'command -v ip && command -v tc && command -v iptables && command -v unshare' \
    iproute2 iptables util-linux
